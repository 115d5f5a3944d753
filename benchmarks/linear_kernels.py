"""The decoder's linears as a step runs them: every layer's own weights, streamed from
memory, through each kernel the engine can use.

SmolLM2-135M's shapes (hidden 576, q/k/v 960, gate/up 3,072, down 1,536) for 30 layers:
120 distinct weights (212 MB in bf16, more than the caches keep between steps), called
in a decode step's order at the row counts a step has (1: one decode; 8-64: a decode batch;
256-2,048: prompt chunks). Paths: ``plain`` (``F.linear``), ``onednn`` (oneDNN-packed,
``mkldnn::_linear_pointwise``: its blocking chosen by the row count, the engine's path before
batch invariance), and the batch-invariant ones the engine takes now: ``brgemm``
(``worker/kernels/linear.cpp``, where oneDNN's micro-kernel packs the dtype here) and
``invariant`` (``worker/kernels/invariant_linear.cpp``). Rounds alternate the paths; each
figure is the median over rounds of the time for all 120 calls, with its min and max.

    python -m benchmarks.linear_kernels --json-out benchmarks/results/linear_kernels-amx.json
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import torch

from benchmarks.machine import machine, write_report
from worker.kernels import has_native_kernels
from worker.layers.packing import BATCH_HINT, PackedLinear, PackKind, brgemm_packs, packed_linear
from worker.platform import DTYPES, dtype_name

LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down: (out, in)
ROWS = (1, 8, 32, 64, 256, 2048)


Call = tuple[torch.Tensor | None, PackedLinear | None, int]  # weight, packed, in_features


def weights(dtype: torch.dtype, layers: int) -> dict[str, list[Call]]:
    """Per path, each call of a step in the step's order."""
    if not has_native_kernels():
        raise SystemExit("the native kernels are not built here: nothing to compare")
    gen = torch.Generator().manual_seed(0)
    plain = [(torch.randn(n, k, generator=gen) * 0.02).to(dtype) for _ in range(layers) for n, k in LAYER_SHAPES]

    def packed(kind: PackKind, pack) -> list[Call]:
        return [(None, PackedLinear(kind, pack(w), w.shape[0]), w.shape[1]) for w in plain]
    paths = {"plain": [(w, None, w.shape[1]) for w in plain],
             "onednn": packed(PackKind.ONEDNN, lambda w: torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT)),
             "invariant": packed(PackKind.INVARIANT, torch.ops.kervan.pack_invariant)}
    if brgemm_packs(dtype):
        paths["brgemm"] = packed(PackKind.BRGEMM, torch.ops.kervan.pack_linear)
    return paths


def step_seconds(calls: list[Call], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for weight, packed, k in calls:
        packed_linear(inputs[k], weight, packed, None)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    paths = weights(dtype, args.layers)
    nbytes = sum(n * k for n, k in LAYER_SHAPES) * args.layers * torch.empty((), dtype=dtype).element_size()
    flops_per_row = 2 * nbytes / torch.empty((), dtype=dtype).element_size()
    rows_report = {}
    with torch.inference_mode():
        for m in ROWS:
            gen = torch.Generator().manual_seed(m)
            inputs = {k: torch.randn(m, k, generator=gen).to(dtype) for k in {k for _, k in LAYER_SHAPES}}
            times: dict[str, list[float]] = {name: [] for name in paths}
            for calls in paths.values():  # warm-up: oneDNN creates its primitives
                step_seconds(calls, inputs)
            for r in range(args.rounds):
                names = list(paths)[r % len(paths):] + list(paths)[:r % len(paths)]
                for name in names:
                    times[name].append(step_seconds(paths[name], inputs))
            rows_report[str(m)] = {
                name: {"ms": round(median(t) * 1e3, 2), "min_ms": round(min(t) * 1e3, 2),
                       "max_ms": round(max(t) * 1e3, 2), "gb_s": round(nbytes / median(t) / 1e9, 1),
                       "tflop_s": round(m * flops_per_row / median(t) / 1e12, 3)} for name, t in times.items()}
            print(m, {name: v["ms"] for name, v in rows_report[str(m)].items()}, flush=True)
    write_report({"benchmark": "linear_kernels", "machine": machine(args.dtype), "dtype": dtype_name(dtype),
                  "threads": torch.get_num_threads(), "layers": args.layers, "weight_bytes": nbytes,
                  "rounds": args.rounds, "rows": rows_report}, args.json_out)


if __name__ == "__main__":
    main()
