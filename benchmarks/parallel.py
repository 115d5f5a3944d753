"""Decode step time, its roofline, and a worker group against one process.

    python -m benchmarks.parallel                      # 125M-parameter random Llama, float32
    python -m benchmarks.parallel --shape default --buckets 1,8

- ``memory_bandwidth_gb_s``: this machine now (a large tensor copy: bytes read plus
  written per second, the median of several).
- ``decode``: one process's decode step time per batch bucket (every sequence has the
  same context), the median of ``--steps`` steps after warm-up.
- ``roofline``: at batch 1, the bytes a decode step must read (every weight matrix
  but the embedding, which is one row per token, plus the KV of the context) over the
  measured bandwidth, and the fraction of it the measured step reaches.
- ``results/parallel.png``: step time per bucket for both, and the batch-1 roofline.
- ``tensor_parallel``: the same buckets on a worker group of ``--tensor-parallel``
  ranks, one thread each, against one process with as many threads on the same
  cores. On a 2-core machine this shows what the group's communication costs (a
  broadcast and two all-reduces per layer per step over loopback gloo); it cannot
  show a gain, which needs ranks with memory bandwidth of their own (GPUs or sockets).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from benchmarks import plots
from benchmarks.machine import add_dtype_argument, machine
from benchmarks.models import SHAPES, ensure_random_llama
from worker import Engine, SamplingParams

CONTEXT = 64  # prompt tokens of every sequence


def memory_bandwidth_gb_s(mib: int = 512, repeats: int = 7) -> float:
    src = torch.ones(mib << 18, dtype=torch.float32)  # mib MiB
    dst = torch.empty_like(src)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        rates.append(2 * src.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return round(statistics.median(rates), 2)


def decode_step_ms(engine: Engine, batch: int, steps: int, vocab: int) -> float:
    """Median time of a decode step with ``batch`` sequences of CONTEXT tokens."""
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        prompt = torch.randint(3, vocab, (CONTEXT,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    while engine.stats().num_prefill_tokens:  # prefill first: only decode steps are timed
        engine.step()
    for _ in range(3):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return round(statistics.median(times) * 1e3, 3)


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


def run(model_dir, dtype: str, buckets: list[int], steps: int, threads: int, tp: int, vocab: int) -> dict:
    torch.set_num_threads(threads)
    engine = Engine.from_pretrained(model_dir, dtype=dtype, num_kv_blocks=max(buckets) * 8 + 64,
                                    tensor_parallel_size=tp, max_num_seqs=max(buckets))
    try:
        decode_step_ms(engine, 1, 3, vocab)  # warm-up: first-call costs, oneDNN kernels
        step_ms = {str(b): decode_step_ms(engine, b, steps, vocab) for b in buckets}
        parameters, weight_bytes = weights(engine)
        return {"decode_step_ms": step_ms, "parameters": parameters,
                "bytes_per_step_batch_1": weight_bytes + kv_bytes(engine, CONTEXT),
                "tokens_per_s": {b: round(int(b) / ms * 1e3, 1) for b, ms in step_ms.items()}}
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="125m", choices=sorted(SHAPES))
    ap.add_argument("--vocab-size", type=int, default=32000)
    add_dtype_argument(ap)
    ap.add_argument("--buckets", default="1,2,4,8,16,32", help="decode batch sizes")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per bucket")
    ap.add_argument("--tensor-parallel", type=int, default=2, help="ranks of the worker group compared (1: skip)")
    args = ap.parse_args()
    buckets = [int(b) for b in args.buckets.split(",")]
    model_dir = ensure_random_llama(args.vocab_size, args.shape)
    cores = len(os.sched_getaffinity(0))
    bandwidth = memory_bandwidth_gb_s()
    one = run(model_dir, args.dtype, buckets, args.steps, cores, 1, args.vocab_size)
    step_1 = one["decode_step_ms"]["1"] if 1 in buckets else None
    roofline_ms = one["bytes_per_step_batch_1"] / (bandwidth * 1e9) * 1e3
    report = {"benchmark": "parallel", "machine": machine(args.dtype), "model": str(model_dir),
              "parameters": one.pop("parameters"),
              "memory_bandwidth_gb_s": bandwidth, "context_tokens": CONTEXT, "one_process": one,
              "roofline": {"bytes_per_step": one["bytes_per_step_batch_1"], "roofline_ms": round(roofline_ms, 3),
                           "step_ms": step_1,
                           "fraction": round(roofline_ms / step_1, 3) if step_1 else None}}
    if args.tensor_parallel > 1:
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // args.tensor_parallel))  # the peers' threads
        group = run(model_dir, args.dtype, buckets, args.steps, max(1, cores // args.tensor_parallel),
                    args.tensor_parallel, args.vocab_size)
        report["tensor_parallel"] = {
            "ranks": args.tensor_parallel, "threads_per_rank": max(1, cores // args.tensor_parallel),
            "decode_step_ms": group["decode_step_ms"],
            "group_vs_one_process": {b: round(one["decode_step_ms"][b] / ms, 3)
                                     for b, ms in group["decode_step_ms"].items()}}
    print(json.dumps(report, indent=2))
    series = {"one process": list(one["decode_step_ms"].values())}
    if "tensor_parallel" in report:
        series[f"{args.tensor_parallel} ranks"] = list(report["tensor_parallel"]["decode_step_ms"].values())
    plots.lines("parallel", f"Decode step, {report['parameters'] / 1e6:.0f}M-parameter model "
                f"({report['machine']['dtype']}, {cores} cores)", buckets, series, "sequences in the batch",
                "step time (ms)", {"batch-1 roofline": round(roofline_ms, 2)})


if __name__ == "__main__":
    main()
