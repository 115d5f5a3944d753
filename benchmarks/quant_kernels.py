"""Kervan's quantized matmul against PyTorch's own CPU kernels for the same weights, and
the dense bf16 matmul, on SmolLM2-135M's shapes.

- int8 per channel: ``quant_linear`` against ``torch.ops.aten._weight_int8pack_mm``.
- int4, groups of 64 with zeros: ``quant_linear`` against ``_weight_int4pack_mm_for_cpu``
  on the ``_convert_weight_to_int4pack_for_cpu`` layout (tinygemm's: scales and zeros
  ``[groups, N, 2]`` in bf16, ``w = (q - 8) * scale + zero``).
- dense: ``F.linear`` on the bf16 weight (oneDNN).

bf16 activations, rows 1, 8 and 32 (decode batches), each shape's weights cycled through
enough copies (``--copies``) that they come from DRAM as a decode step's do, rounds
interleaving the kernels; times are per call, ratios are against dense bf16 in the same
round. Each PyTorch kernel's result is checked against Kervan's before it is timed.

    python -m benchmarks.quant_kernels --json-out benchmarks/results/quant-kernels-avx512.json
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.machine import machine, write_report
from benchmarks.stats import spread

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
GROUP = 64


def torch_int4(w: torch.Tensor):
    """w [N, K] float -> (packed, scales_and_zeros) for ``_weight_int4pack_mm_for_cpu``."""
    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale  # tinygemm's zero: the value of code 8
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([scale.T, zero.T], dim=-1).bfloat16().contiguous()
    return packed, sz


def kernels(w: torch.Tensor, x: torch.Tensor) -> dict:
    from worker.quant.matmul import quant_linear
    from worker.quant.method import get_method
    q8 = get_method("int8").quantize(w)
    q4 = get_method("int4").quantize(w)
    w8 = q8.codes.view(torch.int8)
    s8 = (q8.scales.float().flatten() * q8.tensor_scale).bfloat16()
    packed, sz = torch_int4(w)
    wb = w.bfloat16()
    return {
        "dense_bf16": lambda: torch.nn.functional.linear(x, wb),
        "kervan_int8": lambda: quant_linear(x, q8),
        "torch_int8pack": lambda: torch.ops.aten._weight_int8pack_mm(x, w8, s8),
        "kervan_int4": lambda: quant_linear(x, q4),
        "torch_int4pack": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz),
    }


def check(fns: dict) -> None:
    """PyTorch's kernels compute what Kervan's do (different rounding of the same weights)."""
    for ours, theirs, tol in (("kervan_int8", "torch_int8pack", 0.02), ("kervan_int4", "torch_int4pack", 0.1)):
        a, b = fns[ours]().float(), fns[theirs]().float()
        err = ((a - b).norm() / a.norm()).item()
        assert err < tol, f"{theirs} disagrees with {ours}: relative error {err:.3f}"


def measure(shape: tuple[int, int], rows: int, copies: int, rounds: int, calls: int) -> dict:
    n, k = shape
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    sets = [kernels(torch.randn(n, k, generator=gen) * 0.02, x) for _ in range(copies)]
    check(sets[0])
    times = {name: [] for name in sets[0]}
    for _ in range(rounds):
        for name in times:
            for fns in sets:  # warm the code path, not the weights: the loop below evicts them
                fns[name]()
            start = time.perf_counter()
            for _ in range(calls):
                for fns in sets:
                    fns[name]()
            times[name].append((time.perf_counter() - start) / (calls * copies))
    out = {name: {"us_per_call": spread([t * 1e6 for t in ts])} for name, ts in times.items()}
    for name, ts in times.items():
        out[name]["vs_dense_bf16"] = spread([d / t for d, t in zip(times["dense_bf16"], ts)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--copy-mb", type=float, default=256.0, help="bf16 bytes of weights cycled per shape")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    results = {}
    for name, (n, k) in SHAPES.items():
        copies = max(2, int(args.copy_mb * 1e6 / (n * k * 2)))
        results[name] = {"shape": [n, k], "copies": copies,
                         **{f"rows_{r}": measure((n, k), r, copies, args.rounds, args.calls) for r in args.rows}}
    write_report({"machine": machine("bfloat16"), "args": vars(args), "threads": torch.get_num_threads(),
                  "results": results}, args.json_out)


if __name__ == "__main__":
    main()
