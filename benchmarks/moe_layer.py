"""One mixture-of-experts layer's routed experts: the fused native call
(``worker/kernels/moe_experts.h``, one parallel region per phase over every chosen expert's
column blocks) against the per-expert path it replaced (each expert's two linears called in
turn from Python, ``index_add_`` per expert: the skeptic's baseline, still the path where the
native kernels are absent), in one process, on the same weights and tokens, rounds rotated.

The layer is Qwen1.5-MoE-A2.7B's (60 experts of 1,408, top 4, hidden 2,048; ``--experts``
etc. change it), its experts in the model's dtype (``--dtype``: the layout the loader packs
them in here: brgemm with AMX, else the invariant kernel's) or quantized (``--quantization
int4``/``int8``: the int8-activation layout). Tokens are routed by a random router, and each
call has new tokens, so it reads the distinct experts they chose, mostly not cached by the call
before (the layer's 60 experts are 1 GB in bf16); the report gives, per token count, both
paths' median time (and range) over ``--rounds``, the experts read, and the bytes they hold
over the time against the machine's read bandwidth measured in the same run (``bandwidth_share``:
1.0 is the memory bound; a call of many tokens is bound by compute instead).

    python -m benchmarks.moe_layer --dtype bfloat16 --json-out benchmarks/results/moe_layer-amx-bf16.json
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.machine import machine, write_report
from benchmarks.stats import spread
from control_plane.plan.hardware import read_bandwidth
from worker.config import MoeConfig
from worker.kernels import has_native_kernels
from worker.layers.moe import SparseMoe, select_experts
from worker.platform import parse_dtype


def build_layer(args, dtype: torch.dtype) -> SparseMoe:
    cfg = MoeConfig(num_experts=args.experts, top_k=args.top_k, intermediate_size=args.inter,
                    norm_topk_prob=False)
    layer = SparseMoe(args.hidden, cfg, dtype, ("gate_proj", "up_proj", "down_proj"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.gate.copy_(torch.randn(layer.gate.shape, generator=gen) * 0.02)
        for param in (layer.w13, layer.w2):
            for e in range(args.experts):  # one expert at a time: no float32 copy of all of them
                param[e].copy_(torch.randn(param.shape[1:], generator=gen) * 0.02)
    if args.quantization:
        from worker.quant.kernel_choice import with_int8
        from worker.quant.method import get_method
        layer.quantize(get_method(args.quantization))
        layer.expert_quants = [(with_int8(a, 2), with_int8(b, 2)) for a, b in layer.expert_quants]
    layer.pack()
    return layer


def expert_bytes(layer: SparseMoe) -> int:
    if layer.expert_quants is not None:
        return sum(q.int8.nbytes for q in layer.expert_quants[0])
    return sum(p.data.nbytes for p in layer.expert_packs[0])


def routed(layer: SparseMoe, n: int, calls: int, seed: int) -> list[tuple]:
    """``calls`` batches of n new tokens, each with its routing: every call reads the experts its
    own tokens chose, mostly not in cache from the call before."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(calls + 1):
        x = torch.randn(n, layer.gate.shape[1], generator=gen).to(layer.gate.dtype)
        weights, ids = select_experts(layer._linear(x.float(), layer.packed_gate), layer.cfg, None)
        out.append((x, weights, ids))
    return out


def time_calls(layer: SparseMoe, batches: list[tuple], fused: bool) -> float:
    """Seconds of the layer's routed experts over ``batches`` but the first (a warm-up); the
    shared expert and the router's matmul are part of neither path."""
    if not fused:  # the per-expert path: as the layer runs where no fused call is made
        layer._fused_source, layer._fused = layer.expert_quants or layer.expert_packs, None
    else:
        layer._fused_source = None  # made again on the next call
    total = 0.0
    with torch.inference_mode():
        for i, (x, weights, ids) in enumerate(batches):
            start = time.perf_counter()
            layer._all_reduced(x, weights, ids)
            total += (time.perf_counter() - start) if i else 0.0
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None, help="int4 or int8: the experts quantized")
    ap.add_argument("--experts", type=int, default=60)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--tokens", default="1,8,32,512")
    ap.add_argument("--calls", type=int, default=10, help="calls timed per point and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if not has_native_kernels():
        raise SystemExit("the fused experts are a native kernel: build the kernels first")
    dtype = parse_dtype(args.dtype)
    layer = build_layer(args, dtype)
    per_expert = expert_bytes(layer)
    points = []
    rounds = []
    for r in range(args.rounds):
        bandwidth = read_bandwidth()
        row = {"memory_bandwidth_gb_s": round(bandwidth / 1e9, 2), "points": []}
        for n in map(int, args.tokens.split(",")):
            batches = routed(layer, n, args.calls, seed=100 * r + n)
            order = (True, False) if r % 2 == 0 else (False, True)  # rotated
            times = {("fused" if f else "per_expert"): time_calls(layer, batches, f) for f in order}
            experts = [ids.unique().numel() for _, _, ids in batches[1:]]
            read = sum(experts) * per_expert
            row["points"].append({"tokens": n, "experts_read": round(sum(experts) / args.calls, 1),
                                  **{f"{k}_ms": round(v / args.calls * 1e3, 3) for k, v in times.items()},
                                  **{f"{k}_bandwidth_share": round(read / v / bandwidth, 3) for k, v in times.items()}})
            p = row["points"][-1]
            print(f"round {r} tokens {n:4d}: experts {p['experts_read']:5.1f}  fused {p['fused_ms']:8.2f} ms "
                  f"({p['fused_bandwidth_share']:.2f} of bandwidth)  per-expert {p['per_expert_ms']:8.2f} ms "
                  f"({p['per_expert_bandwidth_share']:.2f})", flush=True)
        rounds.append(row)
    for i, first in enumerate(rounds[0]["points"]):
        mine = [r["points"][i] for r in rounds]
        points.append({"tokens": first["tokens"], "experts_read": spread([p["experts_read"] for p in mine]),
                       **{key: spread([p[key] for p in mine]) for key in first if key.endswith(("_ms", "_share"))},
                       "speedup": spread([p["per_expert_ms"] / p["fused_ms"] for p in mine])})
    report = {"benchmark": "moe_layer", "machine": machine(args.dtype), "arguments": vars(args),
              "expert_bytes": per_expert,
              "memory_bandwidth_gb_s": spread([r["memory_bandwidth_gb_s"] for r in rounds]),
              "points": points, "rounds": rounds}
    write_report(report, args.json_out)


if __name__ == "__main__":
    main()
