"""A prompt's causal attention on the CPU: what PyTorch's SDPA takes against the floor of its
parts, on one sequence of SmolLM2's heads (issue 50: the prefill step's attention, 120 of
~420 ms for 4 x 512 tokens on the AMX Xeon).

Per round, in this order, each timed as the median of ``--calls`` calls:

- ``sdpa_ms``: ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` on q, k and v
  as the engine passes them, strided views into one qkv matmul output [L, (H + 2 Hkv) D];
- ``qk_ms``: Q K^T over the full square, one batched matmul (K repeated to every query head;
  AMX where the CPU has it);
- ``pv_ms``: P V over the full square, the same way;
- ``exp_ms``: ``exp`` over the full square of float32 scores.

``floor_ms`` is half their sum: the causal half of each, what a fused kernel could not go
under with these parts (it still needs the running maximum, the sums and the conversions).
Medians over ``--rounds`` rounds with their range.

    python -m benchmarks.prefill_attention --json-out benchmarks/results/prefill_attention-amx.json
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from benchmarks.machine import machine, write_report
from benchmarks.stats import spread
from worker.platform import DTYPE_CHOICES, current_platform


def timed(fn, calls: int) -> float:
    """Median ms of ``calls`` calls of ``fn`` (after one warm-up call)."""
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times) * 1e3


def one_round(length: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, calls: int) -> dict:
    group = heads // kv_heads
    qkv = torch.randn(length, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q = qkv[:, :heads * head_dim].view(length, heads, head_dim).transpose(0, 1).unsqueeze(0)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(length, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(length, kv_heads, head_dim)
    k, v = (t.transpose(0, 1).unsqueeze(0) for t in (k, v))
    scale = head_dim ** -0.5
    qd = q.contiguous()[0]
    kd, vd = (t[0].repeat_interleave(group, 0).contiguous() for t in (k, v))
    scores = torch.randn(heads, length, length)
    probs = torch.softmax(scores, -1).to(dtype)
    with torch.inference_mode():
        out = {"sdpa_ms": timed(lambda: sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=True), calls),
               "qk_ms": timed(lambda: torch.bmm(qd, kd.transpose(1, 2)), calls),
               "pv_ms": timed(lambda: torch.bmm(probs, vd), calls),
               "exp_ms": timed(lambda: scores.exp(), calls)}
    out["floor_ms"] = (out["qk_ms"] + out["pv_ms"] + out["exp_ms"]) / 2
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=512, help="the prompt's tokens")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="auto", type=str.lower, choices=DTYPE_CHOICES)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    dtype = current_platform().resolve_dtype(args.dtype, "cpu")
    rounds = [one_round(args.length, args.heads, args.kv_heads, args.head_dim, dtype, args.calls)
              for _ in range(args.rounds)]
    report = {"benchmark": "prefill_attention", "machine": machine(args.dtype), "threads": torch.get_num_threads(),
              **{key: spread([r[key] for r in rounds]) for key in rounds[0]}}
    report["sdpa_over_floor"] = spread([r["sdpa_ms"] / r["floor_ms"] for r in rounds])
    write_report(report, args.json_out, args)


if __name__ == "__main__":
    main()
