"""The plan: the first layout, fewest devices first, that fits and meets both targets, its
pools, and the reasons, as one record (``Plan``) the command prints and writes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from control_plane.plan.aggregated import aggregated_pool
from control_plane.plan.hardware import Hardware
from control_plane.plan.model_shape import ModelShape
from control_plane.plan.pools import decode_pool, prefill_pool
from control_plane.plan.profile import Profile
from control_plane.plan.sizing import Layout, Load, Sizer, Slo, layouts


@dataclass
class Plan:
    model: dict
    hardware: dict
    load: dict
    slo: dict
    layout: dict
    memory_per_device: dict
    decode: dict
    prefill: dict
    pools: dict
    expected: dict
    roofline: dict
    meets_slo: bool
    reasons: list[str] = field(default_factory=list)
    aggregated: dict | None = None  # the alternative: workers that prefill and decode both
    recommended: str = "disaggregated"  # or "aggregated", when it meets the targets on fewer devices

    def to_dict(self) -> dict:
        return asdict(self)


def plan(shape: ModelShape, weights: str, dtype: str, hw: Hardware, load: Load, slo: Slo,
         chunk: int = 2048, profile: Profile | None = None) -> Plan:
    """The first layout, fewest devices first, that fits and meets both targets; if none
    does, the one that came closest (fits, and the lowest ITL), with ``meets_slo`` False.
    A ``profile`` was measured on one process: the plan keeps to that layout."""
    sizer = Sizer(shape, weights, dtype, hw, chunk, profile)
    max_model_len = min(shape.max_position, load.max_input_len + load.max_output_len)
    context = load.input_len + load.output_len / 2  # a decoding sequence's mean context
    tried, best = [], None
    for layout in layouts(shape, hw) if profile is None else [Layout(1, 1)]:
        memory = sizer.memory(layout, max_model_len)
        if not memory["fits"]:
            tried.append(f"{layout}: does not fit ({memory['kv_tokens']:,} KV tokens per device left, "
                         f"{max_model_len:,} needed for one sequence)")
            continue
        candidate = _size_pools(sizer, layout, memory, load, slo, context)
        candidate.reasons = tried + candidate.reasons
        if candidate.meets_slo:
            return candidate
        tried.append(f"{layout}: fits, but {candidate.reasons[-1]}")
        if best is None or candidate.decode["itl_s"] < best.decode["itl_s"]:
            best = candidate
    if best is None:
        raise ValueError(f"{shape.name} in {weights} fits no layout of up to 64 {hw.name} devices: " + "; ".join(tried))
    best.reasons = tried + ["no layout meets both targets: this is the closest (lowest ITL)"]
    return best


def _size_pools(sizer: Sizer, layout: Layout, memory: dict, load: Load, slo: Slo, context: float) -> Plan:
    hw, shape = sizer.hw, sizer.shape
    reasons = [f"{layout} of {hw.name}: holds the weights ({memory['weights_bytes'] / 1e9:.2f} GB per device) "
               "and one longest sequence's KV (layouts are tried from the fewest devices up)"]
    if sizer.profile is not None:
        kind = "served profile (through the router, on the cores the serving stack shares)" \
            if sizer.profile.served else "engine's profile"
        reasons.append(f"step times from the {kind} ({sizer.profile.dtype}, measured on "
                       f"{sizer.profile.machine.get('cpu', '?')}), not the roofline")
    d = decode_pool(sizer, layout, memory, load, slo, context)
    top = d.steps[d.max_batch]
    if d.meets_itl:
        cap = max(d.steps)
        limit = ("the ITL target" if d.max_batch < cap else
                 "the KV cache" if cap == d.kv_batch_limit else "the engine's cap")
        reasons.append(f"decode batch {d.max_batch}: the largest that {limit} allows "
                       f"(a step {top['step_s'] * 1e3:.2f} ms, {top['bound']}-bound)")
    demand = load.rate * load.output_len
    reasons.append(f"{d.workers} decode worker(s): {demand:,.0f} output tok/s asked, "
                   f"{d.tokens_per_s_per_worker:,.0f} per worker at batch {d.max_batch}; each then runs about "
                   f"{d.operating_batch} sequences")
    p = prefill_pool(sizer, layout, load, slo, d.operating_batch)
    reasons.append(f"{p.workers} prefill worker(s): {load.rate * load.input_len:,.0f} prompt tok/s asked, "
                   f"{p.tokens_per_s_per_worker:,.0f} per worker ({p.chunk['bound']}-bound chunks of "
                   f"{sizer.chunk}); TTFT {p.ttft_s * 1e3:,.0f} ms = prompt {p.one_prompt_s * 1e3:,.0f} + queue "
                   f"+ KV hand-over {p.kv_handover_s * 1e3:.1f}")
    meets = d.meets_itl and p.ttft_s <= slo.ttft_s
    a = aggregated_pool(sizer, layout, memory, load, slo, context)
    recommended = "disaggregated"
    if a is None:
        reasons.append("aggregated workers: no prefill chunk fits beside the decodes within the ITL target")
    else:
        better = a.meets and (not meets or a.workers < p.workers + d.workers)
        recommended = "aggregated" if better else recommended
        reasons.append(f"aggregated alternative: {a.workers} worker(s) with {a.chunk}-token chunks beside up to "
                       f"{a.max_batch} decodes, ITL {a.step_s * 1e3:.2f} ms while prompts wait, TTFT "
                       f"{a.ttft_s * 1e3:,.0f} ms: " + ("fewer devices, so it is the recommendation" if better else
                                                         "no fewer devices, so the pools above stay"
                                                         if a.meets else "misses the TTFT target"))
    if not d.meets_itl:
        reasons.append(f"even batch 1 misses the ITL target ({d.steps[1]['step_s'] * 1e3:.2f} ms a step)")
    elif not meets:
        reasons.append(f"TTFT {p.ttft_s * 1e3:,.0f} ms misses its target: one prompt alone takes "
                       f"{p.one_prompt_s * 1e3:,.0f} ms")
    return Plan(
        model={"name": shape.name, "parameters": shape.num_params, "active_parameters": shape.active_params,
               "weights": sizer.weights, "dtype": sizer.dtype,
               "kv_bytes_per_token": shape.kv_bytes_per_token(sizer.dtype)},
        hardware={"name": hw.name, "kind": hw.kind, "memory_bytes": hw.memory_bytes, "bandwidth": hw.bandwidth,
                  "peak_flops": sizer.peak, "memory_efficiency": hw.memory_efficiency,
                  "compute_efficiency": hw.compute_efficiency, "source": hw.source},
        load=asdict(load), slo=asdict(slo),
        layout={"tp": layout.tp, "pp": layout.pp, "ep": layout.tp if shape.is_moe else 1, "devices": layout.devices},
        memory_per_device=memory,
        decode={"max_batch": d.max_batch, "operating_batch": d.operating_batch, "itl_s": d.itl_s,
                "tokens_per_s_per_worker": d.tokens_per_s_per_worker, "workers": d.workers,
                "kv_batch_limit": d.kv_batch_limit},
        prefill={"chunk_tokens": sizer.chunk, "tokens_per_s_per_worker": p.tokens_per_s_per_worker,
                 "workers": p.workers, "one_prompt_s": p.one_prompt_s, "kv_handover_s": p.kv_handover_s,
                 "ttft_s": p.ttft_s},
        pools={"prefill": p.workers, "decode": d.workers, "ratio": f"{p.workers}:{d.workers}",
               "devices": (p.workers + d.workers) * layout.devices},
        expected=({"output_tokens_per_s": demand, "ttft_s": a.ttft_s, "itl_s": a.step_s}
                  if a is not None and recommended == "aggregated" else
                  {"output_tokens_per_s": demand if meets else min(demand, d.workers * d.tokens_per_s_per_worker),
                   "ttft_s": p.ttft_s, "itl_s": d.itl_s}),
        roofline={"decode_at_operating_batch": d.steps[d.operating_batch], "decode_at_max_batch": top,
                  "prefill_chunk": p.chunk},
        meets_slo=meets or recommended == "aggregated", reasons=reasons,
        aggregated=None if a is None else {**a._asdict(), "devices": a.workers * layout.devices},
        recommended=recommended)
