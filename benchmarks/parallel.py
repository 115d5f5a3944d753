"""Decode step time and its roofline; worker groups (tensor, expert and pipeline
parallel) against one process; torch.compile against eager on the CPU, CUDA graphs
against eager on a GPU.

    python -m benchmarks.parallel --json-out benchmarks/results/parallel-amx.json   # ~12 min, dtype auto
    python -m benchmarks.parallel --buckets 1,8 --groups none --compile-buckets none   # the roofline only

- ``dense.one_process``: one process's decode step time per batch bucket (every
  sequence has the same context) on a 125M-parameter Llama, the median of ``--steps``
  steps after warm-up, in each of ``--rounds`` rounds; ``dense.roofline``: per bucket,
  the bytes a decode step must read (every weight matrix but the embedding, which is
  one row per token, plus the batch's KV) over the machine's read bandwidth, measured
  between that bucket's steps (a float32 sum far past the caches, every few steps: the
  ceiling as it stood while the steps ran, not a copy's rate taken once before), and
  the fraction of that bound each round's step reaches.
- ``dense.tensor_parallel`` / ``dense.pipeline_parallel``, ``moe.expert_parallel`` /
  ``moe.tensor_parallel`` (on a Mixtral): the same buckets on a worker group of two
  ranks, one thread each, against one process with as many threads on the same cores,
  with the bytes each step sent between ranks per token (``*_bytes_per_token``: the
  experts' all-to-all, the all-reduces, the pipeline's hand-overs). On a 2-core
  machine this shows what a group's communication costs; it cannot show a gain,
  which needs ranks with memory bandwidth of their own (GPUs or sockets).
- ``cpu_compile``: the dense model's forward for a decode step, eager with Kervan's
  native kernels (what the engine runs), eager in plain PyTorch, and ``torch.compile``d
  plain PyTorch (the native kernels are opaque to it), with the compile time.
- ``cuda_graphs`` (on a GPU): decode steps replaying CUDA graphs against eager.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

import torch

from benchmarks.machine import add_dtype_argument, machine, write_report
from benchmarks.models import ensure_random_model
from benchmarks.stats import spread
from control_plane.plan.hardware import read_bandwidth
from worker import Engine, SamplingParams
from worker.parallel.state import TRAFFIC

CONTEXT = 64  # prompt tokens of every sequence


BANDWIDTH_EVERY = 5  # timed steps between two read-bandwidth measurements


class Bucket(NamedTuple):
    step_ms: float  # the median timed step
    traffic: dict[str, int]  # bytes sent between a group's ranks per decoded token, by collective
    read_gb_s: float  # the machine's read bandwidth, the median of those measured between the steps


def decode_step_ms(engine: Engine, batch: int, steps: int, vocab: int, buffer: torch.Tensor | None = None) -> Bucket:
    """Time decode steps of ``batch`` sequences of CONTEXT tokens; with a 1 GiB ``buffer``,
    measure the read bandwidth on it before the first timed step and after every BANDWIDTH_EVERY."""
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        prompt = torch.randint(3, vocab, (CONTEXT,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    while engine.stats().num_prefill_tokens:  # prefill first: only decode steps are timed
        engine.step()
    for _ in range(3):
        engine.step()
    TRAFFIC.clear()
    times, rates = [], []
    for i in range(steps):
        if buffer is not None and i % BANDWIDTH_EVERY == 0:
            rates.append(read_bandwidth(repeats=2, buffer=buffer) / 1e9)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    traffic = {kind: round(sent / (batch * steps)) for kind, sent in sorted(TRAFFIC.items())}
    while engine.has_unfinished_requests():
        engine.step()
    return Bucket(round(statistics.median(times) * 1e3, 3), traffic,
                  round(statistics.median(rates), 2) if rates else 0.0)


def weights(engine: Engine) -> tuple[int, int]:
    """(parameters of the model, bytes of weights a decode step reads: every matrix but
    the embedding, which is one row per token), from its shape (a dense Llama)."""
    cfg = engine.model_config
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    read = cfg.num_layers * layer + cfg.vocab_size * h  # layers and LM head
    elem = torch.empty((), dtype=engine.config.dtype).element_size()
    return read + cfg.vocab_size * h, read * elem


def kv_bytes(engine: Engine, tokens: int) -> int:
    cfg = engine.model_config
    elem = torch.empty((), dtype=engine.config.dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * tokens * elem


def run(model_dir, dtype: str, buckets: list[int], steps: int, threads: int, vocab: int, device: str = "cpu",
        rounds: int = 1, bandwidth: bool = False, **options) -> dict:
    """Decode step time per bucket on an engine of ``options`` (a worker group's sizes,
    ``enforce_eager``), each bucket timed in ``rounds`` rounds (its median reported), with the
    bytes sent between its ranks per decoded token; with ``bandwidth``, the roofline too."""
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # a group's peers take it
    engine = Engine.from_pretrained(model_dir, dtype=dtype, device=device, num_kv_blocks=max(buckets) * 8 + 64,
                                    max_num_seqs=max(buckets), **options)
    try:
        decode_step_ms(engine, 1, 3, vocab)  # warm-up: first-call costs, oneDNN kernels
        buffer = torch.ones(1 << 28) if bandwidth else None  # 1 GiB, read between the steps
        measured = [{str(b): decode_step_ms(engine, b, steps, vocab, buffer) for b in buckets}
                    for _ in range(rounds)]
        del buffer
        parameters, weight_bytes = weights(engine)
        step_ms = {b: statistics.median(r[b].step_ms for r in measured) for b in measured[0]}
        out = {"decode_step_ms": step_ms, "parameters": parameters,
               "decode_step_ms_rounds": {b: [r[b].step_ms for r in measured] for b in step_ms},
               "bytes_between_ranks_per_token": {b: t.traffic for b, t in measured[-1].items() if t.traffic},
               "tokens_per_s": {b: round(int(b) / ms * 1e3, 1) for b, ms in step_ms.items()}}
        if bandwidth:
            out["roofline"] = roofline(measured, weight_bytes, engine)
        return out
    finally:
        engine.close()


def roofline(measured: list[dict[str, Bucket]], weight_bytes: int, engine: Engine) -> dict:
    """Per bucket: the bytes a step reads, and per round the read bandwidth measured
    between its steps, the bound it gives and the fraction of it the step reached."""
    out = {}
    for b in measured[0]:
        nbytes = weight_bytes + int(b) * kv_bytes(engine, CONTEXT)
        bound = [nbytes / (r[b].read_gb_s * 1e9) * 1e3 for r in measured]
        fraction = [ms / r[b].step_ms for ms, r in zip(bound, measured)]
        out[b] = {"bytes_per_step": nbytes, "read_gb_s_rounds": [r[b].read_gb_s for r in measured],
                  "bound_ms_rounds": [round(x, 3) for x in bound], "fraction": spread(fraction)}
    return out


def against(one: dict, group: dict, ranks: int, threads: int) -> dict:
    return {"ranks": ranks, "threads_per_rank": threads, "decode_step_ms": group["decode_step_ms"],
            "group_vs_one_process": {b: round(one["decode_step_ms"][b] / ms, 3)
                                     for b, ms in group["decode_step_ms"].items()},
            "bytes_between_ranks_per_token": group["bytes_between_ranks_per_token"]}


def forward_ms(engine: Engine, batch: int, compiled: bool, steps: int) -> tuple[float, float]:
    """(median ms of the model's forward on a decode step of ``batch`` rows with CONTEXT
    tokens each, seconds the first call took: compiling, when ``compiled``)."""
    from worker.layers.paged_attention import AttentionMetadata
    runner, bs = engine.runner, engine.config.block_size
    width = CONTEXT // bs + 1
    tables = [[row * width + i for i in range(width)] for row in range(batch)]
    meta = AttentionMetadata.build([t[CONTEXT // bs] * bs + CONTEXT % bs for t in tables], tables,
                                   [CONTEXT + 1] * batch, [], bs, torch.device("cpu"), runner.native_kernels)
    model = torch.compile(runner.model, dynamic=False) if compiled else runner.model
    stack = runner.model.decode_stack
    if stack is not None and not compiled:  # what the engine runs: the embedding, then the stack's layers (no head)
        def model(ids, positions, kv_caches, meta):
            return stack.native.run(runner.model.embed(ids), positions, meta.slots, meta.decode_tables,
                                    meta.decode_lens)
    ids, positions = torch.full((batch,), 5), torch.full((batch,), CONTEXT)
    with torch.inference_mode():
        start = time.perf_counter()
        model(ids, positions, runner.kv_caches, meta)
        first = time.perf_counter() - start
        times = []
        for _ in range(steps + 2):
            start = time.perf_counter()
            model(ids, positions, runner.kv_caches, meta)
            times.append(time.perf_counter() - start)
    return round(statistics.median(times[2:]) * 1e3, 3), round(first, 1)


def cpu_compile(model_dir, dtype: str, buckets: list[int], steps: int, child: bool) -> dict:
    """Per bucket: eager with the native kernels here; eager and compiled plain PyTorch in
    a child process (the kernels' choice is made once per process)."""
    engine = Engine.from_pretrained(model_dir, dtype=dtype, num_kv_blocks=max(buckets) * (CONTEXT // 16 + 1) + 8)
    if child:
        return {str(b): {"eager_torch_ms": forward_ms(engine, b, False, steps)[0],
                         **dict(zip(("compiled_torch_ms", "compile_s"), forward_ms(engine, b, True, steps)))}
                for b in buckets}
    native = {str(b): forward_ms(engine, b, False, steps)[0] for b in buckets}
    env = {**os.environ, "KERVAN_ATTENTION_BACKEND": "torch", "KERVAN_WEIGHT_PACKING": "off"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.parallel", "--compile-child", "--dtype", dtype,
                          "--compile-buckets", ",".join(map(str, buckets)), "--steps", str(steps)],
                         env=env, capture_output=True, text=True, check=True)
    plain = json.loads(out.stdout)
    report = {b: {"eager_native_ms": native[b], **plain[b]} for b in native}
    faster = [b for b, r in report.items() if r["compiled_torch_ms"] < 0.9 * r["eager_native_ms"]]
    return {"buckets": report, "compile_pays_at": faster,
            "engine_runs": "eager" if not faster else "eager (compile would pay at " + ",".join(faster) + ")"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab-size", type=int, default=32000)
    add_dtype_argument(ap)
    ap.add_argument("--buckets", default="1,2,4,8,16,32", help="decode batch sizes")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per bucket")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the one-process buckets and their roofline")
    ap.add_argument("--json-out", default=None, help="also write the report here (with the commit)")
    ap.add_argument("--groups", default="tensor,pipeline,expert",
                    help="worker groups of two ranks to compare with one process (none: skip)")
    ap.add_argument("--compile-buckets", default="1,8", help="buckets for eager vs torch.compile (none: skip)")
    ap.add_argument("--device", default="cpu", help="cuda: CUDA graphs against eager, instead of the CPU parts")
    ap.add_argument("--compile-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    buckets = [int(b) for b in args.buckets.split(",")]
    dense = ensure_random_model(args.vocab_size, "125m")
    if args.compile_child:
        print(json.dumps(cpu_compile(dense, args.dtype, [int(b) for b in args.compile_buckets.split(",")],
                                     args.steps, child=True)))
        return
    cores = len(os.sched_getaffinity(0))
    report = {"benchmark": "parallel", "machine": machine(args.dtype), "context_tokens": CONTEXT}
    if args.device.startswith("cuda"):
        graphs = run(dense, args.dtype, buckets, args.steps, cores, args.vocab_size, args.device)
        eager = run(dense, args.dtype, buckets, args.steps, cores, args.vocab_size, args.device, enforce_eager=True)
        report["cuda_graphs"] = {"graphs_ms": graphs["decode_step_ms"], "eager_ms": eager["decode_step_ms"],
                                 "eager_vs_graphs": {b: round(eager["decode_step_ms"][b] / ms, 3)
                                                     for b, ms in graphs["decode_step_ms"].items()}}
        write_report(report, args.json_out, args)
        return
    one = run(dense, args.dtype, buckets, args.steps, cores, args.vocab_size, rounds=args.rounds, bandwidth=True)
    report["dense"] = {"model": str(dense), "parameters": one.pop("parameters"), "roofline": one.pop("roofline"),
                       "one_process": one}
    groups = [g for g in args.groups.split(",") if g in ("tensor", "pipeline", "expert")]
    threads = max(1, cores // 2)
    for kind in [g for g in groups if g != "expert"]:
        group = run(dense, args.dtype, buckets, args.steps, threads, args.vocab_size, **{f"{kind}_parallel_size": 2})
        report["dense"][f"{kind}_parallel"] = against(one, group, 2, threads)
    if "expert" in groups:
        moe = ensure_random_model(args.vocab_size, "moe")
        one_moe = run(moe, args.dtype, buckets, args.steps, cores, args.vocab_size)
        report["moe"] = {"model": str(moe), "one_process": {"decode_step_ms": one_moe["decode_step_ms"]}}
        for kind in ("expert", "tensor"):
            group = run(moe, args.dtype, buckets, args.steps, threads, args.vocab_size,
                        **{f"{kind}_parallel_size": 2})
            report["moe"][f"{kind}_parallel"] = against(one_moe, group, 2, threads)
    if args.compile_buckets != "none":
        torch.set_num_threads(cores)
        report["cpu_compile"] = cpu_compile(dense, args.dtype, [int(b) for b in args.compile_buckets.split(",")],
                                            args.steps, child=False)
    write_report(report, args.json_out, args)


if __name__ == "__main__":
    main()
