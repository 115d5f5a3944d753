"""A prompt's causal attention on the CPU: what the engine's kernel and PyTorch's SDPA take
against the floors of their parts, on one sequence (SmolLM2's heads by default; issue 50: the
prefill step's attention, 120 of ~420 ms for 4 x 512 tokens on the AMX Xeon; issue 67: 158 of
~1,030 ms for 512 tokens at Llama-3.2-1B's).

Per round, in this order, each timed as the median of ``--calls`` calls:

- ``rows_ms``: the engine's prompt attention, ``kervan::paged_decode`` with every token a row
  attending to its prefix through the block table (batch-invariant: a token's bits are those of
  its decode), on a paged cache holding the prompt's keys and values;
- ``fp32_gflop_s``: a float32 matmul's rate (2048 square), the rate that path's float32 FMAs
  could reach; ``rows_floor_ms`` is its FLOPs (4 x heads x head_dim x L(L+1)/2) at that rate;

- ``sdpa_ms``: ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` on q, k and v
  as the engine passes them, strided views into one qkv matmul output [L, (H + 2 Hkv) D];
- ``qk_ms``: Q K^T over the full square, one batched matmul (K repeated to every query head;
  AMX where the CPU has it);
- ``pv_ms``: P V over the full square, the same way;
- ``exp_ms``: ``exp`` over the full square of float32 scores.

``floor_ms`` is half their sum: the causal half of each, what a fused kernel could not go
under with these parts (it still needs the running maximum, the sums and the conversions).
SDPA's flash kernel tiles the keys from the chunk's start, so a token's bits depend on how its
prompt was cut: it is the engine's path only where batch invariance is off (not the default).
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
from worker.kernels import has_native_kernels
from worker.layers.paged_attention import AttentionMetadata
from worker.platform import DTYPE_CHOICES, current_platform
from worker.runner.model_runner import allocate_kv_caches

BLOCK_SIZE = 16


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
    rows = prompt_rows(qkv, length, heads, kv_heads, head_dim) if has_native_kernels() else None
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    with torch.inference_mode():
        out = {}
        if rows is not None:
            flops = 4 * heads * head_dim * length * (length + 1) / 2
            out["rows_ms"] = timed(lambda: torch.ops.kervan.paged_decode(*rows, scale), calls)
            out["fp32_gflop_s"] = 2 * 2048 ** 3 / timed(lambda: a @ b, max(3, calls // 4)) / 1e6
            out["rows_floor_ms"] = flops / out["fp32_gflop_s"] / 1e6
        out |= {"sdpa_ms": timed(lambda: sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=True), calls),
               "qk_ms": timed(lambda: torch.bmm(qd, kd.transpose(1, 2)), calls),
               "pv_ms": timed(lambda: torch.bmm(probs, vd), calls),
               "exp_ms": timed(lambda: scores.exp(), calls)}
    out["floor_ms"] = (out["qk_ms"] + out["pv_ms"] + out["exp_ms"]) / 2
    return out


def prompt_rows(qkv: torch.Tensor, length: int, heads: int, kv_heads: int, head_dim: int) -> tuple:
    """paged_decode's arguments for the prompt in qkv as the engine passes them in batch-invariant
    mode: its keys and values written to a paged cache (blocks in a shuffled order), every token a
    row with the prompt's block table and its own length."""
    q, k, v = (t.view(length, -1, head_dim) for t in qkv.split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1))
    num_blocks = -(-length // BLOCK_SIZE)
    [cache] = allocate_kv_caches(1, num_blocks, kv_heads, BLOCK_SIZE, head_dim, qkv.dtype, torch.device("cpu"))
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    slots = [blocks[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(length)]
    meta = AttentionMetadata.build(slots, [], [], [(0, length, 0, blocks)], BLOCK_SIZE, torch.device("cpu"),
                                   native=True, per_token=True)
    torch.ops.kervan.write_kv(cache, k.contiguous(), v.contiguous(), meta.slots)
    return q.contiguous(), cache, meta.decode_tables, meta.decode_lens


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
    if "rows_ms" in rounds[0]:
        report["rows_over_floor"] = spread([r["rows_ms"] / r["rows_floor_ms"] for r in rounds])
        report["rows_over_sdpa"] = spread([r["rows_ms"] / r["sdpa_ms"] for r in rounds])
    write_report(report, args.json_out, args)


if __name__ == "__main__":
    main()
