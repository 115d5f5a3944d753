"""The KV tiers behind the engine's pool, against the pool alone (or one tier setting
against another), in the same run: each workload runs its variants alternating per round
(medians over rounds, with their range; ratios against the first variant, round by round).

- ``revisits`` (off, on): documents revisited (multi-turn chat, a document asked about
  again) whose working set is ``--working-set`` times the pool. Each request is one
  document (a fixed random prompt of ``--doc-len`` tokens) followed by a fresh 8-token
  question, for ``--output-len`` greedy tokens; ``--concurrency`` requests in flight. Every
  document is visited once first (cold, not counted), then ``--visits`` times in a seeded
  random order. Reported: the revisits' time to first token (p50, p99), output tokens/s.
- ``preemption`` (off, on): more long generations than the pool holds (``--streams`` of
  ``--reason-prompt`` prompt tokens and ``--reason-output`` output tokens each, all at
  once): the engine preempts; with the tier a preempted sequence resumes by copying its
  blocks back. Reported: output tokens/s, preemptions, blocks copied back.
- ``reuse-gate`` (gate-1, gate-2: ``--kv-offload-min-uses``): ``--gate-hot`` documents
  revisited among ``--gate-scan`` one-off documents per hot visit (a scan), in a host tier
  that holds ``--gate-host-docs`` documents: with the gate at 1 the scan flushes the hot set
  from the tier, at 2 it never enters. Reported: the hot revisits' hit rate and TTFT, output
  tokens/s.
- ``write-policy`` (back, through): ``revisits`` on the disk tier, written when the host
  tier lets a block go (write-back) or as soon as it is demoted (write-through).
- ``itl`` (pool, host, recompute) and ``bandwidth``: what the copies cost
  (``benchmarks/kv_tier_copies.py``).

``--tier disk`` puts the disk tier under test instead: "on" is a host tier of ``--disk-host-bytes``
(a pool or so) in front of a disk tier of ``--disk-bytes`` in a fresh directory under
``--disk-dir``, so revisits mostly come back from disk. ``--drop-caches`` (root) makes those
reads real ones: the page cache is dropped after the cold pass, and the tier's files are
advised out of it (``POSIX_FADV_DONTNEED``) every 20 ms during the revisits.

``revisits`` also runs ``pool+``, the baseline a skeptic picks: no tier, the pool enlarged by
the tier's bytes (the host tier's; with ``--tier disk``, the host and disk tiers' together), in
the same memory. Its ratios against "off" sit beside the tier's.

    python -m benchmarks.kv_tiers --model smollm2-135m --workloads revisits,itl --json-out /tmp/kv_tiers.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path
from statistics import median
from typing import NamedTuple

from benchmarks.kv_tier_copies import bandwidth, itl, percentile
from benchmarks.machine import add_dtype_argument, machine, write_report
from benchmarks.stats import spread
from control_plane.tools.pull import resolve_model
from worker import Engine, SamplingParams
from worker.config import EngineConfig, ModelConfig
from worker.default_model import ensure_default_model
from worker.platform import current_platform


class Loop(NamedTuple):
    ttft: list[float]  # seconds, in the order of the prompts
    cached: list[int]  # prompt tokens found cached (any tier), in the order of the prompts
    tokens: int  # output tokens
    seconds: float


def run_closed_loop(engine: Engine, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> Loop:
    """Each prompt once, ``concurrency`` in flight."""
    pending = list(enumerate(prompts))
    sent: dict[str, tuple[int, float]] = {}
    ttft = [0.0] * len(prompts)
    cached = [0] * len(prompts)
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
                cached[k] = out.num_cached_tokens
                del sent[out.request_id]
    return Loop(ttft, cached, tokens, time.perf_counter() - start)


def tiers(args, on: bool, tier: str | None = None) -> dict:
    """The engine options of the tier under test (``--tier``, or ``tier``), on or off."""
    if not on:
        return {}
    if (tier or args.tier) == "host":
        return {"kv_host_bytes": args.host_bytes}
    return {"kv_host_bytes": args.disk_host_bytes, "kv_disk_bytes": args.disk_bytes,
            "kv_disk_dir": tempfile.mkdtemp(prefix="kervan-kv-tiers-", dir=args.disk_dir)}


def block_bytes(model_dir, dtype: str) -> int:
    """One KV block's bytes in the tiers, for this model and dtype."""
    model = ModelConfig.from_dir(model_dir)
    return EngineConfig(dtype=dtype).resolve(model, current_platform()).bytes_per_block(model)


def close(engine: Engine) -> None:
    engine.close()
    if engine.config.kv_disk_dir:
        shutil.rmtree(engine.config.kv_disk_dir, ignore_errors=True)


def documents(engine: Engine, rng: random.Random, count: int, length: int) -> list[list[int]]:
    vocab = min(engine.model_config.vocab_size, 30000)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def question(engine: Engine, rng: random.Random) -> list[int]:
    vocab = min(engine.model_config.vocab_size, 30000)
    return [rng.randrange(3, vocab) for _ in range(8)]


def tier_bytes(args) -> int:
    return args.host_bytes if args.tier == "host" else args.disk_host_bytes + args.disk_bytes


def revisits(model_dir, args, variant: str, rng_seed: int) -> dict:
    options = tiers(args, True, "disk") | {"kv_disk_write": variant} if variant in ("back", "through") \
        else tiers(args, variant == "on")
    blocks = args.pool_blocks + (tier_bytes(args) // block_bytes(model_dir, args.dtype) if variant == "pool+" else 0)
    engine = Engine.from_pretrained(model_dir, dtype=args.dtype, num_kv_blocks=blocks,
                                    max_num_seqs=args.concurrency, **options)
    rng = random.Random(rng_seed)
    pool_tokens = args.pool_blocks * engine.config.block_size
    docs = documents(engine, rng, max(2, args.working_set * pool_tokens // args.doc_len), args.doc_len)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    run_closed_loop(engine, [d + question(engine, rng) for d in docs], params, args.concurrency)  # cold
    order = [d for _ in range(args.visits) for d in docs]
    rng.shuffle(order)
    with uncached(engine.config.kv_disk_dir if args.drop_caches else None):
        loop = run_closed_loop(engine, [d + question(engine, rng) for d in order], params, args.concurrency)
    stats = engine.stats()
    close(engine)
    return {"documents": len(docs), "pool_blocks": blocks, "ttft_p50_ms": median(loop.ttft) * 1e3,
            "ttft_p99_ms": percentile(loop.ttft, 99) * 1e3, "output_tokens_per_s": loop.tokens / loop.seconds,
            "host_promoted_blocks": stats.num_host_promoted, "disk_stored_blocks": stats.num_disk_stored,
            "disk_loaded_blocks": stats.num_disk_loaded, "disk_write_dropped_blocks": stats.num_disk_write_dropped}


@contextlib.contextmanager
def uncached(directory: str | None):
    """While open: the page cache dropped once, then ``directory``'s files advised out of it
    every 20 ms, so the disk tier's reads reach the device (nothing when ``directory`` is None)."""
    if directory is None:
        yield
        return
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    done = threading.Event()

    def advise() -> None:
        while not done.wait(0.02):
            for path in Path(directory).rglob("*"):
                if path.is_file():
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)

    thread = threading.Thread(target=advise, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def preemption(model_dir, args, variant: str, rng_seed: int, streams: int) -> dict:
    engine = Engine.from_pretrained(model_dir, dtype=args.dtype, num_kv_blocks=args.pool_blocks,
                                    max_num_seqs=streams, **tiers(args, variant == "on"))
    prompts = documents(engine, random.Random(rng_seed), streams, args.reason_prompt)
    params = SamplingParams(max_tokens=args.reason_output, temperature=0, ignore_eos=True)
    loop = run_closed_loop(engine, prompts, params, streams)
    stats = engine.stats()
    close(engine)
    return {"output_tokens_per_s": loop.tokens / loop.seconds, "preemptions": stats.num_preemptions,
            "host_promoted_blocks": stats.num_host_promoted, "disk_loaded_blocks": stats.num_disk_loaded}


def reuse_gate(model_dir, args, variant: str, rng_seed: int) -> dict:
    """Hot documents among one-off ones; the host tier holds ``--gate-host-docs`` documents."""
    doc_blocks = -(-(args.doc_len + 8) // 16)
    engine = Engine.from_pretrained(model_dir, dtype=args.dtype, num_kv_blocks=args.pool_blocks,
                                    kv_host_bytes=args.gate_host_docs * doc_blocks * block_bytes(model_dir, args.dtype),
                                    kv_offload_min_uses=int(variant.removeprefix("gate-")))
    rng = random.Random(rng_seed)
    hot = documents(engine, rng, args.gate_hot, args.doc_len)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    run_closed_loop(engine, [d + question(engine, rng) for d in hot + hot], params, 1)  # two uses each: warm
    visits = [(True, d) for _ in range(args.visits) for d in hot]
    visits += [(False, d) for d in documents(engine, rng, args.gate_scan * len(visits), args.doc_len)]  # once each
    rng.shuffle(visits)
    loop = run_closed_loop(engine, [d + question(engine, rng) for _, d in visits], params, 1)
    hot_k = [k for k, (is_hot, _) in enumerate(visits) if is_hot]
    close(engine)
    return {"hot_hit_rate": sum(loop.cached[k] for k in hot_k) / (len(hot_k) * args.doc_len),
            "hot_ttft_p50_ms": median(loop.ttft[k] for k in hot_k) * 1e3,
            "output_tokens_per_s": loop.tokens / loop.seconds}


def copy_itl(model_dir, args, variant: str, rng_seed: int) -> dict:
    doc_blocks = -(-(args.doc_len + 8 + args.output_len) // 16)
    stream_blocks = args.itl_streams * -(-(32 + args.itl_output) // 16)
    holds = args.itl_docs if variant == "pool" else 3  # documents the pool holds beside the streams
    engine = Engine.from_pretrained(model_dir, dtype=args.dtype, num_kv_blocks=stream_blocks + holds * doc_blocks + 1,
                                    max_num_seqs=args.itl_streams + 1, **tiers(args, variant == "host", "host"))
    out = itl(engine, args, rng_seed)
    close(engine)
    return out


def copies(model_dir, args, variant: str, rng_seed: int) -> dict:
    engine = Engine.from_pretrained(model_dir, dtype=args.dtype, num_kv_blocks=max(args.pool_blocks, 65),
                                    **(tiers(args, True) | {"kv_host_bytes": args.host_bytes}))
    out = bandwidth(engine)
    close(engine)
    return out


# each workload's variants (the first is the baseline) and the metrics compared against it:
# a latency (``_ms``) as baseline over variant, anything else as variant over baseline: > 1 is better
WORKLOADS = {
    "revisits": (revisits, ("off", "on", "pool+"), ("ttft_p50_ms", "ttft_p99_ms", "output_tokens_per_s")),
    "preemption": (preemption, ("off", "on"), ("output_tokens_per_s",)),
    "reuse-gate": (reuse_gate, ("gate-1", "gate-2"), ("hot_hit_rate", "hot_ttft_p50_ms", "output_tokens_per_s")),
    "write-policy": (revisits, ("back", "through"), ("ttft_p50_ms", "output_tokens_per_s")),
    "itl": (copy_itl, ("pool", "host", "recompute"), ("itl_p50_ms", "itl_p99_ms", "revisit_ttft_p50_ms")),
    "bandwidth": (copies, ("copies",), ()),
}


def ratios(runs: dict[str, list[dict]], variants: tuple[str, ...], metrics: tuple[str, ...]) -> dict:
    base, out = variants[0], {}
    for variant in variants[1:]:
        for m in metrics:
            pairs = list(zip(runs[base], runs[variant]))
            if m.endswith("_ms"):
                out[f"{m}_{base}_over_{variant}"] = spread([b[m] / v[m] for b, v in pairs])
            else:
                out[f"{m}_{variant}_over_{base}"] = spread([v[m] / b[m] if b[m] else None for b, v in pairs])
    if "plain_copy_gb_s" in runs[base][0]:
        for way in ("promote", "promote_scattered", "demote", "demote_scattered"):
            for plain in ("plain_copy", "plain_copy_in_turn"):
                out[f"{way}_over_{plain}"] = spread([r[f"{way}_gb_s"] / r[f"{plain}_gb_s"] for r in runs[base]])
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
    ap.add_argument("--drop-caches", action="store_true",
                    help="disk reads from the device: drop the page cache and keep the tier's files out of it (root)")
    ap.add_argument("--doc-len", type=int, default=1024)
    ap.add_argument("--working-set", type=int, default=10, help="documents' tokens, in pools")
    ap.add_argument("--visits", type=int, default=2, help="revisits of each document")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--streams", default="8", help="long generations at once (preemption); a comma list runs "
                                                   "each count as its own workload (preemption-N)")
    ap.add_argument("--reason-prompt", type=int, default=256)
    ap.add_argument("--reason-output", type=int, default=512)
    ap.add_argument("--gate-hot", type=int, default=4, help="hot documents (reuse-gate)")
    ap.add_argument("--gate-scan", type=int, default=3, help="one-off documents per hot visit (reuse-gate)")
    ap.add_argument("--gate-host-docs", type=int, default=6, help="documents the host tier holds (reuse-gate)")
    ap.add_argument("--itl-streams", type=int, default=4, help="decode streams beside the revisits (itl)")
    ap.add_argument("--itl-output", type=int, default=256, help="tokens each decode stream generates (itl)")
    ap.add_argument("--itl-docs", type=int, default=8, help="documents revisited beside them (itl)")
    ap.add_argument("--workloads", default="revisits,preemption,bandwidth", help=", ".join(WORKLOADS))
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    model_dir = resolve_model(args.model) if args.model else ensure_default_model()
    runs = {}
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            ap.error(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
        fn, variants, metrics = WORKLOADS[name]
        if name == "preemption":
            counts = [int(n) for n in args.streams.split(",")]
            for n in counts:
                runs["preemption" if len(counts) == 1 else f"preemption-{n}"] = (
                    functools.partial(preemption, streams=n), variants, metrics)
        else:
            runs[name] = (fn, variants, metrics)
    results: dict[str, dict[str, list[dict]]] = {w: {v: [] for v in variants} for w, (_, variants, _) in runs.items()}
    for r in range(args.rounds):
        for name, (fn, variants, _) in runs.items():
            for variant in (variants if r % 2 == 0 else variants[::-1]):
                out = fn(model_dir, args, variant, rng_seed=r)
                results[name][variant].append(out)
                print(f"round {r} {name} {variant}: " + ", ".join(f"{k} {v:.2f}" for k, v in out.items()), flush=True)
                gc.collect()
    summary = {}
    for name, (_, variants, metrics) in runs.items():
        by_variant = results[name]
        keys = by_variant[variants[0]][0].keys()
        summary[name] = {v: {k: spread([o[k] for o in outs]) for k in keys} for v, outs in by_variant.items()}
        summary[name]["ratios"] = ratios(by_variant, variants, metrics)
    report = {"benchmark": "kv_tiers", "model": args.model or "embedded", "machine": machine(args.dtype),
              "arguments": vars(args), "summary": summary, "rounds": results}
    write_report(report, args.json_out)


if __name__ == "__main__":
    main()
