"""Where a step's time goes, against what the machine allows: the engine on a real model
at decode batches of 1, 8, 32 and 64 and on a prefill step, each op class's time per step
(a torch profile) beside the step's bounds, measured by this run on this machine:

- the memory bound: the bytes a step must read (every weight once; at decode, the KV
  cache of every sequence) over the bandwidth of a 1 GiB float32 sum;
- the compute bound: the step's matmul FLOPs over the rate of a 2048^3 matmul in the
  model's dtype (AMX where present).

``--rounds`` (3) repeats the whole measure, bounds included, on new prompts: each point is
the rounds' median, its bound share's range beside it, and every round is in the report.
A MoE step reads the routed experts it runs (counted by recomputing each layer's routing
in the profiled steps; ``routed_experts_read``), a prompt every expert. A decode step of a small
model is bound by memory, a prefill step by compute; the report
gives each step's time over its larger bound (``bound_share``: 1.0 would be the hardware's
limit). ``python_ms`` is the step's wall time outside any profiled op: the engine's
Python (scheduling, step inputs, the model's module calls); a residual of two sets of steps
(unprofiled walls, profiled ops), it moves by a millisecond between runs. Where the decode
stack serves every step, ``outside_stack_share`` is measured directly instead, without the
profiler: the share of the steps' wall time outside its one native call (Python, and the
sampler's argmax over the logits).

    python -m benchmarks.step_profile --model smollm2-135m --dtype bfloat16 \\
        --json-out benchmarks/results/step_profile-amx-smollm2.json
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from statistics import median

import torch

from benchmarks.machine import machine, write_report
from benchmarks.stats import spread
from control_plane.plan.hardware import matmul_rate, read_bandwidth
from control_plane.tools.pull import resolve_model
from worker import Engine, SamplingParams
from worker.default_model import ensure_default_model

OP_CLASSES = {  # op name -> class; anything else is "other" (allocations, views, copies)
    "kervan::brgemm_linear": "linear", "mkldnn::_linear_pointwise": "linear", "aten::addmm": "linear",
    "aten::mm": "linear", "kervan::paged_decode": "attention", "aten::_scaled_dot_product_flash_attention_for_cpu":
    "attention", "kervan::write_kv": "kv_write", "kervan::add_rms_norm": "norm", "kervan::rms_norm": "norm",
    "kervan::silu_and_mul": "activation", "kervan::rotary": "rotary", "kervan::argmax_rows": "sampling",
    "aten::argmax": "sampling", "aten::embedding": "embedding",
    "kervan::quant_matmul": "linear", "kervan::quant_matmul_i8": "linear", "kervan::invariant_linear": "linear",
    "kervan::moe_experts_brgemm": "experts", "kervan::moe_experts_invariant": "experts",
    "kervan::moe_experts_i8": "experts",
}


def model_costs(engine: Engine) -> dict:
    """Bytes of the weights a step reads and matmul FLOPs per token (a quantized weight: the
    bytes its decode kernel reads, the int8 kernel's packed copy or the codes, scales and zeros)."""
    model = engine.runner.model
    cfg = model.cfg
    element = torch.empty((), dtype=engine.config.dtype).element_size()
    matmul_params, weight_bytes = 0, 0
    for m in model.dense_linears():
        q = m.quant
        if q is not None:
            matmul_params += q.out_features * q.in_features
            weight_bytes += q.int8.nbytes if q.int8 is not None else q.nbytes
        else:
            out_features = m.packed.out_features if m.packed is not None else m.weight.shape[0]
            matmul_params += out_features * m.input_size
            weight_bytes += out_features * m.input_size * element
    expert_bytes, expert_flops = 0, 0  # one routed expert's (its three matrices), and per token all top-k's
    experts = sum(moe.num_local_experts for moe in model.moes)
    if model.moes:
        moe = model.moes[0]
        inter = moe.cfg.intermediate_size
        expert_flops = 2 * 3 * inter * cfg.hidden_size * moe.cfg.top_k * len(model.moes)
        if moe.expert_quants is not None:
            expert_bytes = sum(q.int8.nbytes if q.int8 is not None else q.nbytes for q in moe.expert_quants[0])
        else:
            expert_bytes = 3 * inter * cfg.hidden_size * element
    return {"weight_bytes": weight_bytes, "matmul_flops_per_token": 2 * matmul_params + expert_flops,
            "expert_bytes": expert_bytes, "experts": experts,
            "kv_bytes_per_token": cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * element,
            "attention_flops_per_context_token": cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim}


class _ExpertsRead:
    """Counts the distinct routed experts each MoE layer runs, recomputing the routing from the
    layer's input (the model calls ``forward`` itself, so it is wrapped, not hooked): a step
    reads those experts' weights, no others."""

    def __init__(self, model):
        from worker.layers.moe import select_experts
        self.distinct, self.moes = 0, model.moes

        def counted(moe):
            forward = moe.forward

            def run(x):
                logits = moe._linear(x.float(), moe.packed_gate or moe.gate.float())
                self.distinct += select_experts(logits, moe.cfg, moe.correction_bias)[1].unique().numel()
                return forward(x)
            return run
        for moe in self.moes:
            moe.forward = counted(moe)

    def close(self) -> None:
        for moe in self.moes:
            del moe.forward  # the class's again


class _TimedStack:
    """The decode stack's native object, timing its one call a step (no profiler)."""

    def __init__(self, native):
        self.native, self.seconds, self.calls = native, 0.0, 0

    def step(self, *args):
        start = time.perf_counter()
        try:
            return self.native.step(*args)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def profile_steps(engine: Engine, steps: int) -> tuple[float, dict, float | None, float]:
    """Median wall time of ``steps`` steps, each op class's time per step (over as many more,
    profiled), where the decode stack ran every step, the share of their wall time outside its
    native call (Python and sampling, measured without a profiler), and the routed experts a
    profiled step ran (all MoE layers')."""
    stack = engine.runner.model.decode_stack
    timed = _TimedStack(stack.native) if stack is not None else None
    walls = []
    if timed is not None:
        stack.native = timed
    try:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
    finally:
        if timed is not None:
            stack.native = timed.native
    outside = None
    if timed is not None and timed.calls == steps:
        outside = round(1 - timed.seconds / sum(walls), 3)
    experts = _ExpertsRead(engine.runner.model)
    try:
        with torch.profiler.profile() as prof:
            for _ in range(steps):
                engine.step()
    finally:
        experts.close()
    classes: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        classes[OP_CLASSES.get(event.key, "other")] += event.self_cpu_time_total / 1e3 / steps
    return median(walls), dict(classes), outside, experts.distinct / steps


def decode_point(engine: Engine, batch: int, context: int, costs: dict, bandwidth: float, peak: float,
                 steps: int, seed: int = 0) -> dict:
    vocab = engine.runner.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(batch + 1000 * seed)  # new prompts each round: no prefix hits
    for _ in range(batch):
        prompt = torch.randint(3, vocab, (context,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=4 * steps, temperature=0, ignore_eos=True))
    while engine.scheduler.waiting or any(seq.num_computed_tokens < seq.num_tokens - 1
                                          for seq in engine.scheduler.running):  # prompts still prefilling
        engine.step()
    wall, classes, outside, experts = profile_steps(engine, steps)
    while engine.has_unfinished_requests():
        engine.step()
    kv_bytes = batch * (context + 2 * steps) * costs["kv_bytes_per_token"]
    flops = batch * costs["matmul_flops_per_token"]
    extra = {} if outside is None else {"outside_stack_share": outside}
    if costs["expert_bytes"]:
        extra["routed_experts_read"] = round(experts, 1)
    return _point(f"decode batch {batch}", wall, classes,
                  costs["weight_bytes"] + experts * costs["expert_bytes"] + kv_bytes, flops, bandwidth, peak,
                  batch=batch, context=context, **extra)


def prefill_point(engine: Engine, prompts: int, length: int, costs: dict, bandwidth: float, peak: float,
                  rounds: int, seed: int = 0) -> dict:
    vocab = engine.runner.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(7 + 1000 * seed)
    walls, per_class = [], defaultdict(list)
    for r in range(rounds + 1):
        for _ in range(prompts):
            engine.add_request(torch.randint(3, vocab, (length,), generator=gen).tolist(),
                               SamplingParams(max_tokens=1, temperature=0))
        if r == rounds:  # the last round under the profiler
            with torch.profiler.profile() as prof:
                engine.step()
            for event in prof.key_averages():
                per_class[OP_CLASSES.get(event.key, "other")].append(event.self_cpu_time_total / 1e3)
        else:
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        while engine.has_unfinished_requests():
            engine.step()
    tokens = prompts * length
    flops = tokens * costs["matmul_flops_per_token"] + prompts * length * length / 2 * costs[
        "attention_flops_per_context_token"]
    classes = {k: sum(v) for k, v in per_class.items()}
    nbytes = costs["weight_bytes"] + costs["experts"] * costs["expert_bytes"]  # a long prompt reaches every expert
    return _point(f"prefill {prompts} x {length}", median(walls[1:] or walls), classes, nbytes, flops,
                  bandwidth, peak, tokens=tokens)


def _point(name: str, wall: float, classes: dict, nbytes: float, flops: float, bandwidth: float, peak: float,
           **extra) -> dict:
    memory_ms, compute_ms = nbytes / bandwidth * 1e3, flops / peak * 1e3
    ops_ms = sum(classes.values())
    out = {"step": name, **extra, "wall_ms": round(wall * 1e3, 2),
           "ops_ms": {k: round(v, 2) for k, v in sorted(classes.items(), key=lambda kv: -kv[1])},
           "python_ms": round(max(0.0, wall * 1e3 - ops_ms), 2),
           "memory_bound_ms": round(memory_ms, 2), "compute_bound_ms": round(compute_ms, 2),
           "bound_share": round(max(memory_ms, compute_ms) / (wall * 1e3), 3)}
    print(f"{name:24s} {out['wall_ms']:8.2f} ms  bound {max(memory_ms, compute_ms):7.2f} ms "
          f"({out['bound_share']:.0%})  " + "  ".join(f"{k} {v:.1f}" for k, v in list(out["ops_ms"].items())[:5]),
          flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a catalog name (kervan pull) or model directory "
                                                  "(default: the embedded model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens of each decoding sequence")
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed (and again profiled) per batch")
    ap.add_argument("--prefill", default="4x512", help="PROMPTSxLENGTH of the prefill step")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each with its own bounds; the report's "
                                                           "points are their medians (ranges beside)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    model_dir = resolve_model(args.model) if args.model else ensure_default_model()
    engine = Engine.from_pretrained(model_dir, dtype=args.dtype, kv_cache_memory_bytes=2 << 30)
    dtype = engine.config.dtype
    costs = model_costs(engine)
    prompts, length = map(int, args.prefill.lower().split("x"))
    rounds = []
    for r in range(args.rounds):  # each round measures its own bounds, then every step against them
        bandwidth, peak = read_bandwidth(), matmul_rate(dtype, n=2048, repeats=5)
        print(f"round {r}: memory {bandwidth / 1e9:.1f} GB/s, {dtype} matmul {peak / 1e12:.2f} TFLOP/s", flush=True)
        points = [decode_point(engine, int(b), args.context, costs, bandwidth, peak, args.steps, seed=r)
                  for b in args.batches.split(",")]
        points.append(prefill_point(engine, prompts, length, costs, bandwidth, peak, rounds=3, seed=r))
        rounds.append({"memory_bandwidth_gb_s": round(bandwidth / 1e9, 2),
                       "matmul_peak_tflop_s": round(peak / 1e12, 3), "points": points})
    report = {"benchmark": "step_profile", "model": args.model or "embedded", "machine": machine(args.dtype),
              "memory_bandwidth_gb_s": spread([r["memory_bandwidth_gb_s"] for r in rounds]),
              "matmul_peak_tflop_s": spread([r["matmul_peak_tflop_s"] for r in rounds]),
              "costs": costs, "arguments": vars(args),
              "points": [merged([r["points"][i] for r in rounds]) for i in range(len(rounds[0]["points"]))],
              "rounds": rounds}
    write_report(report, args.json_out)


def merged(points: list[dict]) -> dict:
    """One step over the rounds: each time and bound the rounds' median, the bound share's
    range beside it (each round's share divides by that round's own bounds)."""
    out = dict(points[0])
    for key in ("wall_ms", "python_ms", "memory_bound_ms", "compute_bound_ms", "bound_share"):
        out[key] = round(median(p[key] for p in points), 3)
    classes = {k for p in points for k in p["ops_ms"]}
    out["ops_ms"] = {k: round(median(p["ops_ms"].get(k, 0.0) for p in points), 2) for k in classes}
    out["bound_share_range"] = [min(p["bound_share"] for p in points), max(p["bound_share"] for p in points)]
    out["wall_ms_range"] = [min(p["wall_ms"] for p in points), max(p["wall_ms"] for p in points)]
    out["rounds"] = len(points)
    return out


if __name__ == "__main__":
    main()
