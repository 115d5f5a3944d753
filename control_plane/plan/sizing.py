"""The plan: a layout that fits, the decode batch the latency targets allow, and the
prefill and decode pools a load needs, each choice with its reason.

Per device of a worker group (tensor parallel ``tp`` by pipeline parallel ``pp``; an MoE
model's experts are sharded over the same ``tp`` devices, expert parallel):

    memory   = weights / (tp * pp) + activations + runtime, the rest (of the usable share) KV
    decode step(b) = max(bytes(b) / (bandwidth * eff), b * FLOPs / (tp * peak * eff))
                     + all-reduces (tp > 1) + hand-overs (pp > 1) + the engine's fixed cost
    bytes(b) = (the weights a step of b sequences reads + b * context * KV bytes per token) / tp

(the stages of a pipeline run one after another within a step: pp buys memory, not speed).

The decode batch is the largest whose step meets the ITL target and whose KV fits; the
decode pool is the load's output tokens per second over one worker's at that batch; the
prefill pool is the smallest whose time to first token (the prompt's chunks, the queue as
M/G/1, the KV hand-over, a decode step) meets the TTFT target. Layouts are tried smallest
first; the first that meets both targets is the plan."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from control_plane.plan.hardware import Hardware
from control_plane.plan.model_shape import FLOAT_BYTES, ModelShape
from control_plane.plan.profile import Profile

MAX_NUM_SEQS = 256  # the engine's running-sequence cap (vLLM's default)


@dataclass(frozen=True)
class Load:
    rate: float  # requests per second
    input_len: float  # mean prompt tokens
    output_len: float  # mean output tokens
    max_input_len: int
    max_output_len: int
    input_cv2: float = 0.0  # the prompt length's squared coefficient of variation (0: all alike)


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"TP{self.tp} x PP{self.pp}"


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

    def to_dict(self) -> dict:
        return asdict(self)


class Sizer:
    """The arithmetic for one model, weight format, dtype, device and chunk size; with a
    ``profile``, steps take the engine's measured times instead of the roofline's."""

    def __init__(self, shape: ModelShape, weights: str, dtype: str, hw: Hardware, chunk: int = 2048,
                 profile: Profile | None = None):
        self.shape, self.weights, self.dtype, self.hw, self.chunk = shape, weights, dtype, hw, chunk
        self.profile = profile
        self.floats = FLOAT_BYTES[dtype]
        self.peak = hw.flops("fp8" if weights.startswith("fp8") and "fp8" in hw.peak_flops else dtype)

    def kv_per_token(self, layout: Layout, all_stages: bool = False) -> float:
        """KV bytes per token on one device: heads split over tp (a head kept whole, so with
        fewer KV heads than tp each device holds one), layers over pp (``all_stages``: summed
        over a pipeline's stages, what one tensor-parallel rank's share of a step reads)."""
        heads_per_device = max(1, self.shape.num_kv_heads // layout.tp)
        per_layer = 2 * heads_per_device * self.shape.head_dim * self.floats
        return per_layer * (self.shape.num_layers if all_stages else math.ceil(self.shape.num_layers / layout.pp))

    def memory(self, layout: Layout, max_model_len: int) -> dict:
        s = self.shape
        weights = s.weight_bytes(self.weights, self.dtype) / layout.devices
        per_token = (4 * s.hidden_size + (s.num_heads + 2 * s.num_kv_heads) * s.head_dim / layout.tp
                     + 2 * max(s.intermediate_size, s.expert_intermediate_size * max(s.top_k, 1)) / layout.tp)
        activations = self.chunk * per_token * self.floats + MAX_NUM_SEQS * s.vocab_size * 4  # float32 logits
        usable = self.hw.memory_bytes * self.hw.usable_memory
        kv = usable - weights - activations - self.hw.runtime_bytes
        kv_tokens = max(0, int(kv / self.kv_per_token(layout)))
        return {"device_bytes": self.hw.memory_bytes, "usable_bytes": usable, "weights_bytes": weights,
                "activations_bytes": activations, "runtime_bytes": self.hw.runtime_bytes, "kv_bytes": max(0.0, kv),
                "kv_tokens": kv_tokens, "fits": kv_tokens >= max_model_len}

    def _comm_s(self, layout: Layout, tokens: int) -> float:
        hw, s = self.hw, self.shape
        size = tokens * s.hidden_size * self.floats
        t = 0.0
        if layout.tp > 1:  # two all-reduces a layer (attention and MLP outputs), ring: 2 (tp-1)/tp of the bytes
            t += 2 * s.num_layers * (hw.link_latency_s + 2 * (layout.tp - 1) / layout.tp * size / hw.link_bandwidth)
        if layout.pp > 1:  # the hidden states handed from stage to stage
            t += (layout.pp - 1) * (hw.link_latency_s + size / hw.link_bandwidth)
        return t

    def decode_step_s(self, layout: Layout, batch: int, context: float) -> dict:
        """A decode step's time. A pipeline's stages run one after another for one step, so
        its time is that of a tensor-parallel rank holding every layer: pp buys memory, not
        speed (micro-batches overlap stages for throughput, not for one step's latency)."""
        s, hw = self.shape, self.hw
        nbytes = (s.step_weight_bytes(self.weights, self.dtype, batch) / layout.tp
                  + batch * context * self.kv_per_token(layout, all_stages=True))
        memory_s = nbytes / (hw.bandwidth * hw.memory_efficiency)
        compute_s = batch * s.flops_per_token(context) / layout.tp / (self.peak * hw.compute_efficiency)
        comm_s = self._comm_s(layout, batch)
        total = max(memory_s, compute_s) + comm_s + hw.step_overhead_s
        if self.profile is not None:
            total = self.profile.decode_step_s(batch, context)
        return {"batch": batch, "step_s": total, "memory_s": memory_s, "compute_s": compute_s, "comm_s": comm_s,
                "bound": "memory" if memory_s >= compute_s else "compute", "bytes_per_device": nbytes,
                "source": "profile" if self.profile is not None else "roofline"}

    def prefill_chunk_s(self, layout: Layout, tokens: int, context: float) -> dict:
        s, hw = self.shape, self.hw
        nbytes = s.weight_bytes(self.weights, self.dtype) / layout.tp  # a chunk touches every expert; stages in turn
        memory_s = nbytes / (hw.bandwidth * hw.memory_efficiency)
        compute_s = tokens * s.flops_per_token(context) / layout.tp / (self.peak * hw.compute_efficiency)
        total = max(memory_s, compute_s) + self._comm_s(layout, tokens) + hw.step_overhead_s
        if self.profile is not None:
            total = self.profile.prefill_step_s(tokens)
        return {"tokens": tokens, "step_s": total, "memory_s": memory_s, "compute_s": compute_s,
                "bound": "memory" if memory_s >= compute_s else "compute",
                "source": "profile" if self.profile is not None else "roofline"}


def layouts(shape: ModelShape, hw: Hardware, max_devices: int = 64) -> list[Layout]:
    """Worker-group shapes, fewest devices first, tensor parallel (within a node) before
    pipeline parallel at the same count: TP needs heads divisible by it."""
    out = []
    for tp in (1, 2, 4, 8):
        if tp > hw.devices_per_node or shape.num_heads % tp:
            continue
        for pp in (1, 2, 4, 8):
            if tp * pp <= max_devices and pp <= shape.num_layers:
                out.append(Layout(tp, pp))
    return sorted(out, key=lambda x: (x.devices, x.pp))


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


class DecodePool(NamedTuple):
    max_batch: int  # the largest batch within the ITL target and the KV cache
    operating_batch: int  # the batch each worker runs at the asked load
    itl_s: float
    tokens_per_s_per_worker: float  # at max_batch
    workers: int
    kv_batch_limit: int
    steps: dict[int, dict]  # batch -> the decode step's terms
    meets_itl: bool


class PrefillPool(NamedTuple):
    tokens_per_s_per_worker: float
    one_prompt_s: float  # a mean prompt alone, chunk by chunk
    kv_handover_s: float
    workers: int
    ttft_s: float
    chunk: dict  # the terms of a full chunk


def _decode_pool(sizer: Sizer, layout: Layout, memory: dict, load: Load, slo: Slo, context: float) -> DecodePool:
    kv_batch = max(1, int(memory["kv_tokens"] // context))
    steps = {b: sizer.decode_step_s(layout, b, context) for b in _batches(min(MAX_NUM_SEQS, kv_batch))}
    within = [b for b, st in steps.items() if st["step_s"] <= slo.itl_s]
    batch = max(within) if within else 1
    per_worker = batch / steps[batch]["step_s"]
    demand = load.rate * load.output_len
    workers = max(1, math.ceil(demand / per_worker))
    operating = next((b for b in sorted(steps) if b / steps[b]["step_s"] >= demand / workers), batch)
    return DecodePool(batch, operating, steps[operating]["step_s"], per_worker, workers, kv_batch, steps,
                      bool(within))


def _prefill_pool(sizer: Sizer, layout: Layout, load: Load, slo: Slo, itl_s: float) -> PrefillPool:
    """The smallest pool whose TTFT (a prompt alone, the queue as M/G/1 on the pool seen as
    one server n times as fast — Pollaczek-Khinchine's mean wait, the service time varying as
    the prompt length does — the KV hand-over over the device link, a decode step) meets the
    target; 1,024 workers at most."""
    chunk = sizer.prefill_chunk_s(layout, sizer.chunk, load.input_len / 2)
    rate = sizer.chunk / chunk["step_s"]  # prompt tokens/s of one busy worker
    alone = sum(sizer.prefill_chunk_s(layout, min(sizer.chunk, load.input_len - i), (i + load.input_len) / 2)
                ["step_s"] for i in range(0, math.ceil(load.input_len), sizer.chunk))
    service = load.input_len / rate
    handover = load.input_len * sizer.shape.kv_bytes_per_token(sizer.dtype) / sizer.hw.link_bandwidth
    ttft = math.inf
    for workers in range(1, 1025):
        rho = load.rate * service / workers
        if rho < 1:
            ttft = alone + rho * (service / workers) * (1 + load.input_cv2) / (2 * (1 - rho)) + handover + itl_s
            if ttft <= slo.ttft_s:
                break
    return PrefillPool(rate, alone, handover, workers, ttft, chunk)


def _size_pools(sizer: Sizer, layout: Layout, memory: dict, load: Load, slo: Slo, context: float) -> Plan:
    hw, shape = sizer.hw, sizer.shape
    reasons = [f"{layout} of {hw.name}: holds the weights ({memory['weights_bytes'] / 1e9:.2f} GB per device) "
               "and one longest sequence's KV (layouts are tried from the fewest devices up)"]
    if sizer.profile is not None:
        reasons.append(f"step times from the engine's profile ({sizer.profile.dtype}, measured on "
                       f"{sizer.profile.machine.get('cpu', '?')}), not the roofline")
    d = _decode_pool(sizer, layout, memory, load, slo, context)
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
    p = _prefill_pool(sizer, layout, load, slo, d.itl_s)
    reasons.append(f"{p.workers} prefill worker(s): {load.rate * load.input_len:,.0f} prompt tok/s asked, "
                   f"{p.tokens_per_s_per_worker:,.0f} per worker ({p.chunk['bound']}-bound chunks of "
                   f"{sizer.chunk}); TTFT {p.ttft_s * 1e3:,.0f} ms = prompt {p.one_prompt_s * 1e3:,.0f} + queue "
                   f"+ KV hand-over {p.kv_handover_s * 1e3:.1f} + a decode step")
    meets = d.meets_itl and p.ttft_s <= slo.ttft_s
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
        expected={"output_tokens_per_s": demand if meets else min(demand, d.workers * d.tokens_per_s_per_worker),
                  "ttft_s": p.ttft_s, "itl_s": d.itl_s},
        roofline={"decode_at_operating_batch": d.steps[d.operating_batch], "decode_at_max_batch": top,
                  "prefill_chunk": p.chunk},
        meets_slo=meets, reasons=reasons)


def _batches(cap: int) -> list[int]:
    """1, 2, 3, ... 16, then every 8th, up to ``cap`` (and ``cap`` itself)."""
    out = list(range(1, min(cap, 16) + 1)) + list(range(24, cap + 1, 8))
    return sorted(set(out + [cap]))
