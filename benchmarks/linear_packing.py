"""oneDNN-packed linear weights against plain ``F.linear``, shape by shape.

The shapes of the 58M benchmark model (hidden 512, 8 heads / 4 KV heads of 64,
intermediate 1,536, vocabulary 32,000): the merged q/k/v, o, merged gate/up and
down projections and the LM head, at the row counts a step has (1: one decode;
8-64: a decode batch; 256-2,048: prompt chunks). Each dtype the platform would
pack is measured (``--dtype`` adds others; bf16 on a CPU without AVX-512 is
refused by oneDNN and reported so). The two paths alternate, best of ``--repeat``
timed batches each; the ratio plain/packed above 1 means packing pays.

    python -m benchmarks.linear_packing --json-out benchmarks/results/linear_packing-amx.json
    python -m benchmarks.linear_packing --dtype float32,bfloat16
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from benchmarks.machine import machine, write_report
from worker.layers.packing import BATCH_HINT, packed_linear
from worker.platform import DTYPES, current_platform, dtype_name

SHAPES = {"qkv": (1024, 512), "o_proj": (512, 512), "gate_up": (3072, 512), "down": (512, 1536),
          "lm_head": (32000, 512)}
ROWS = (1, 8, 64, 256, 2048)


def best_us(fn, repeat: int, flops: float) -> float:
    calls = max(1, min(200, int(2e8 / flops)))  # about 0.1-1 ms of work per timed batch
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def measure(dtype: torch.dtype, repeat: int) -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, (n, k) in SHAPES.items():
        weight = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        except RuntimeError as exc:
            return {"refused": str(exc).splitlines()[0]}
        for m in ROWS:
            x = torch.randn(m, k, generator=g).to(dtype)
            plain_fn = functools.partial(packed_linear, x, weight, None, None)
            packed_fn = functools.partial(packed_linear, x, None, packed, None)
            for fn in (plain_fn, packed_fn):  # warm both before either is timed
                fn()
            flops = 2.0 * m * n * k
            plain_us = packed_us = float("inf")
            for _ in range(2):  # alternate, so drift on a shared machine hits both
                plain_us = min(plain_us, best_us(plain_fn, repeat, flops))
                packed_us = min(packed_us, best_us(packed_fn, repeat, flops))
            out[f"{name} {m}x{k}x{n}"] = {"plain_us": round(plain_us, 1), "packed_us": round(packed_us, 1),
                                          "plain_vs_packed": round(plain_us / packed_us, 2),
                                          "packed_gflop_s": round(flops / packed_us / 1e3, 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="", help="comma-separated dtypes to measure besides those packed here")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json-out", default=None, help="also write the report here (with the commit)")
    args = ap.parse_args()
    platform = current_platform()
    dtypes = [d for d in (torch.float32, torch.bfloat16) if platform.can_pack(d, "cpu")]
    dtypes += [DTYPES[d] for d in filter(None, args.dtype.split(",")) if DTYPES[d] not in dtypes]
    report = {"benchmark": "linear_packing", "machine": machine(), "threads": torch.get_num_threads(),
              "batch_hint": BATCH_HINT, "packed_here": [dtype_name(d) for d in dtypes if platform.can_pack(d, "cpu")],
              "dtypes": {}}
    with torch.inference_mode():
        for dtype in dtypes:
            report["dtypes"][dtype_name(dtype)] = measure(dtype, args.repeat)
    write_report(report, args.json_out, args)


if __name__ == "__main__":
    main()
