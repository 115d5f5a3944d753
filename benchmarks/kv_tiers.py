"""The host KV tier behind the engine's pool, on and off, in the same run.

Two workloads, each run with ``kv_host_bytes=0`` and with a host tier, alternating per
round (medians over rounds, with their range):

- ``revisits``: documents revisited (multi-turn chat, a document asked about again) whose
  working set is ``--working-set`` times the pool. Each request is one document (a fixed
  random prompt of ``--doc-len`` tokens) followed by a fresh 8-token question, for
  ``--output-len`` greedy tokens; ``--concurrency`` requests in flight. Every document is
  visited once first (cold, not counted), then ``--visits`` times in a seeded random order.
  Reported: the revisits' time to first token (p50, p99), and output tokens per second.
- ``preemption``: more long generations than the pool holds (``--streams`` of
  ``--reason-prompt`` prompt tokens and ``--reason-output`` output tokens each, all at
  once): the engine preempts; with the tier a preempted sequence resumes by copying its
  blocks back. Reported: output tokens per second, preemptions, blocks copied back;
- ``bandwidth``: 64 blocks promoted (host tier into the pool) and demoted, in GB/s, against a
  plain copy of the same bytes; with ``--tier disk`` also written to and read from the disk tier.

``--tier disk`` puts the disk tier under test instead: "on" is a host tier of ``--disk-host-bytes``
(a pool or so) in front of a disk tier of ``--disk-bytes`` in a fresh directory under
``--disk-dir``, so revisits mostly come back from disk.

    python -m benchmarks.kv_tiers --model smollm2-135m --json-out benchmarks/results/kv_tiers-amx-smollm2.json
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import shutil
import tempfile
import time
from statistics import median

import torch

from benchmarks.machine import add_dtype_argument, machine, write_report
from benchmarks.stats import spread
from worker import Engine, SamplingParams
from worker.default_model import ensure_default_model
from worker.pull import resolve_model


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run_closed_loop(engine: Engine, prompts: list[list[int]], params: SamplingParams, concurrency: int
                    ) -> tuple[list[float], int, float]:
    """Each prompt once, ``concurrency`` in flight: (TTFTs in order of the prompts, output
    tokens, seconds)."""
    pending = list(enumerate(prompts))
    sent: dict[str, tuple[int, float]] = {}
    ttft = [0.0] * len(prompts)
    tokens = 0
    start = time.perf_counter()
    while pending or sent:
        while pending and len(sent) < concurrency:
            k, prompt = pending.pop(0)
            sent[engine.add_request(prompt, params)] = (k, time.perf_counter())
        for out in engine.step():
            k, at = sent[out.request_id]
            if not ttft[k] and out.outputs[0].token_ids:
                ttft[k] = time.perf_counter() - at
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
                del sent[out.request_id]
    return ttft, tokens, time.perf_counter() - start


def tiers(args, on: bool) -> dict:
    """The engine options of the tier under test, on or off."""
    if not on:
        return {}
    if args.tier == "host":
        return {"kv_host_bytes": args.host_bytes}
    return {"kv_host_bytes": args.disk_host_bytes, "kv_disk_bytes": args.disk_bytes,
            "kv_disk_dir": tempfile.mkdtemp(prefix="kervan-kv-tiers-", dir=args.disk_dir)}


def close(engine: Engine) -> None:
    engine.close()
    if engine.config.kv_disk_dir:
        shutil.rmtree(engine.config.kv_disk_dir, ignore_errors=True)


def revisits(model_dir, args, on: bool, rng_seed: int) -> dict:
    engine = Engine.from_pretrained(model_dir, dtype=args.dtype, num_kv_blocks=args.pool_blocks,
                                    max_num_seqs=args.concurrency, **tiers(args, on))
    vocab = min(engine.model_config.vocab_size, 30000)
    rng = random.Random(rng_seed)
    pool_tokens = args.pool_blocks * engine.config.block_size
    num_docs = max(2, args.working_set * pool_tokens // args.doc_len)
    docs = [[rng.randrange(3, vocab) for _ in range(args.doc_len)] for _ in range(num_docs)]
    question = lambda: [rng.randrange(3, vocab) for _ in range(8)]  # noqa: E731
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    run_closed_loop(engine, [d + question() for d in docs], params, args.concurrency)  # cold: every doc once
    order = [d for _ in range(args.visits) for d in docs]
    rng.shuffle(order)
    ttft, tokens, seconds = run_closed_loop(engine, [d + question() for d in order], params, args.concurrency)
    stats = engine.stats()
    close(engine)
    return {"documents": num_docs, "ttft_p50_ms": median(ttft) * 1e3, "ttft_p99_ms": percentile(ttft, 99) * 1e3,
            "output_tokens_per_s": tokens / seconds, "host_promoted_blocks": stats.num_host_promoted,
            "disk_loaded_blocks": stats.num_disk_loaded, "disk_write_dropped_blocks": stats.num_disk_write_dropped}


def preemption(model_dir, args, on: bool, rng_seed: int, streams: int) -> dict:
    engine = Engine.from_pretrained(model_dir, dtype=args.dtype, num_kv_blocks=args.pool_blocks,
                                    max_num_seqs=streams, **tiers(args, on))
    vocab = min(engine.model_config.vocab_size, 30000)
    rng = random.Random(rng_seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.reason_prompt)] for _ in range(streams)]
    params = SamplingParams(max_tokens=args.reason_output, temperature=0, ignore_eos=True)
    _, tokens, seconds = run_closed_loop(engine, prompts, params, streams)
    stats = engine.stats()
    close(engine)
    return {"output_tokens_per_s": tokens / seconds, "preemptions": stats.num_preemptions,
            "host_promoted_blocks": stats.num_host_promoted, "disk_loaded_blocks": stats.num_disk_loaded}


def bandwidth(model_dir, args, blocks: int = 64, reps: int = 10) -> dict:
    """Promotion (host tier -> pool: ``take`` and the step's ``write_blocks``) and demotion
    (pool -> host tier: ``read_blocks`` and ``put``) of ``blocks`` blocks, in GB/s, against a
    plain copy of the same bytes (one contiguous tensor into another)."""
    engine = Engine.from_pretrained(model_dir, dtype=args.dtype, num_kv_blocks=max(args.pool_blocks, blocks + 1),
                                    **(tiers(args, True) | {"kv_host_bytes": args.host_bytes}))
    host, runner = engine.kv.host, engine.runner
    ids = list(range(blocks))
    hashes = [i.to_bytes(32, "big") for i in range(blocks)]
    data = runner.read_blocks(ids)
    nbytes = data.numel() * data.element_size()
    host.put(hashes, data)
    src, dst = data.clone(), torch.empty_like(data)
    rounds = iter(range(1, 1 << 30))

    def fresh() -> list[bytes]:  # hashes the tier does not hold yet: each demotion copies
        r = next(rounds)
        return [r.to_bytes(8, "big") + h for h in hashes]

    def timed(fn) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return nbytes / median(times) / 1e9
    out = {"bytes": nbytes, "plain_copy_gb_s": timed(lambda: dst.copy_(src)),
           "promote_gb_s": timed(lambda: runner.write_blocks(ids, host.take(hashes, copy=False))),
           "demote_gb_s": timed(lambda: host.put(fresh(), runner.read_blocks(ids))),
           # the pool frees a request's blocks tail first: evictions come in descending order
           "demote_scattered_gb_s": timed(lambda: host.put(fresh(), runner.read_blocks(ids[::-1])))}
    disk = engine.kv.disk
    if disk is not None:  # a write is queued, then made; a read of blocks just written comes from the page cache
        def write():
            fresh_hashes = fresh()
            disk.put(fresh_hashes, data)
            disk.fetch(fresh_hashes[-1:]).result()  # after the writes, on the one I/O thread
            return fresh_hashes
        out["disk_write_gb_s"] = timed(write)
        held = write()
        out["disk_read_gb_s"] = timed(lambda: disk.fetch(held).result())
    close(engine)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a catalog name (kervan pull) or model directory "
                                                  "(default: the embedded model)")
    add_dtype_argument(ap)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pool-blocks", type=int, default=128, help="the engine's KV pool, in blocks of 16 tokens")
    ap.add_argument("--host-bytes", type=int, default=1 << 30, help="the host tier when on")
    ap.add_argument("--tier", choices=("host", "disk"), default="host", help="the tier under test")
    ap.add_argument("--disk-bytes", type=int, default=1 << 30, help="the disk tier when on (--tier disk)")
    ap.add_argument("--disk-host-bytes", type=int, default=8 << 20,
                    help="the host tier in front of the disk tier (--tier disk)")
    ap.add_argument("--disk-dir", default=None, help="where the disk tier's directories go (default: the temp dir)")
    ap.add_argument("--doc-len", type=int, default=1024)
    ap.add_argument("--working-set", type=int, default=10, help="documents' tokens, in pools")
    ap.add_argument("--visits", type=int, default=2, help="revisits of each document")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--streams", default="8", help="long generations at once (preemption); a comma list runs "
                                                   "each count as its own workload (preemption-N)")
    ap.add_argument("--reason-prompt", type=int, default=256)
    ap.add_argument("--reason-output", type=int, default=512)
    ap.add_argument("--workloads", default="revisits,preemption,bandwidth")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    model_dir = resolve_model(args.model) if args.model else ensure_default_model()
    runs = {"revisits": revisits} if "revisits" in workloads else {}
    if "preemption" in workloads:
        counts = [int(n) for n in args.streams.split(",")]
        for n in counts:
            runs["preemption" if len(counts) == 1 else f"preemption-{n}"] = functools.partial(preemption, streams=n)
    results: dict[str, dict[str, list[dict]]] = {w: {"off": [], "on": []} for w in runs}
    for r in range(args.rounds):
        for name, fn in runs.items():
            for tier in (("off", "on") if r % 2 == 0 else ("on", "off")):
                out = fn(model_dir, args, tier == "on", rng_seed=r)
                results[name][tier].append(out)
                print(f"round {r} {name} tier {tier}: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()),
                      flush=True)
                gc.collect()
    summary = {}
    if "bandwidth" in workloads:
        copies = [bandwidth(model_dir, args) for _ in range(args.rounds)]
        for c in copies:
            print("bandwidth: " + ", ".join(f"{k} {v:.2f}" for k, v in c.items()), flush=True)
        summary["bandwidth"] = {k: spread([c[k] for c in copies]) for k in copies[0]}
        for way in ("promote", "demote", "demote_scattered"):
            summary["bandwidth"][f"{way}_over_plain_copy"] = spread([c[f"{way}_gb_s"] / c["plain_copy_gb_s"]
                                                                     for c in copies])
    for name, by_tier in results.items():
        keys = by_tier["on"][0].keys()
        summary[name] = {tier: {k: spread([o[k] for o in outs]) for k in keys} for tier, outs in by_tier.items()}
        ratios = {}
        if name == "revisits":
            ratios["revisit_ttft_p50_off_over_on"] = spread([off["ttft_p50_ms"] / on["ttft_p50_ms"] for off, on in
                                                            zip(by_tier["off"], by_tier["on"])])
            ratios["revisit_ttft_p99_off_over_on"] = spread([off["ttft_p99_ms"] / on["ttft_p99_ms"] for off, on in
                                                            zip(by_tier["off"], by_tier["on"])])
        ratios["throughput_on_over_off"] = spread([on["output_tokens_per_s"] / off["output_tokens_per_s"]
                                                   for off, on in zip(by_tier["off"], by_tier["on"])])
        summary[name]["ratios"] = ratios
    report = {"benchmark": "kv_tiers", "model": args.model or "embedded", "machine": machine(args.dtype),
              "arguments": vars(args), "summary": summary, "rounds": results}
    write_report(report, args.json_out)


if __name__ == "__main__":
    main()
