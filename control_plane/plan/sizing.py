"""The arithmetic of a plan: the load and targets, worker-group layouts, and per layout
the memory of a device and the time of a decode step and of a prefill chunk.

Per device of a worker group (tensor parallel ``tp`` by pipeline parallel ``pp``; an MoE
model's experts are sharded over the same ``tp`` devices, expert parallel):

    memory   = weights / (tp * pp) + activations + runtime, the rest (of the usable share) KV
    decode step(b) = max(bytes(b) / (bandwidth * eff), b * FLOPs / (tp * peak * eff))
                     + all-reduces (tp > 1) + hand-overs (pp > 1) + the engine's fixed cost
    bytes(b) = (the weights a step of b sequences reads + b * context * KV bytes per token) / tp

(the stages of a pipeline run one after another within a step: pp buys memory, not speed).
``pools`` turns these into pools, ``choice`` into the plan."""

from __future__ import annotations

import math
from dataclasses import dataclass

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

    def prefill_chunk_s(self, layout: Layout, tokens: int, context: float, decode_batch: int = 0) -> dict:
        s, hw = self.shape, self.hw
        nbytes = s.weight_bytes(self.weights, self.dtype) / layout.tp  # a chunk touches every expert; stages in turn
        memory_s = nbytes / (hw.bandwidth * hw.memory_efficiency)
        compute_s = tokens * s.flops_per_token(context) / layout.tp / (self.peak * hw.compute_efficiency)
        total = max(memory_s, compute_s) + self._comm_s(layout, tokens) + hw.step_overhead_s
        if self.profile is not None:
            total = self.profile.prefill_step_s(tokens, decode_batch)
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


def batches(cap: int) -> list[int]:
    """1, 2, 3, ... 16, then every 8th, up to ``cap`` (and ``cap`` itself)."""
    out = list(range(1, min(cap, 16) + 1)) + list(range(24, cap + 1, 8))
    return sorted(set(out + [cap]))


def batch_cap(memory: dict, context: float) -> int:
    """The most sequences of ``context`` tokens a worker runs: its KV cache's room, the engine's cap."""
    return min(MAX_NUM_SEQS, max(1, int(memory["kv_tokens"] // context)))


def operating_batch(step_s: dict[int, float], tokens_per_s: float, default: int) -> int:
    """The smallest batch whose steps (``step_s``: batch -> seconds) deliver ``tokens_per_s``."""
    return next((b for b in sorted(step_s) if b / step_s[b] >= tokens_per_s), default)


def mg1_wait_s(rate: float, service_s: float, workers: int, cv2: float) -> float:
    """The mean wait in a pool of ``workers`` seen as one server ``workers`` times as fast:
    Pollaczek-Khinchine's M/G/1, the service time varying with squared coefficient ``cv2``;
    infinite when the pool cannot keep up."""
    rho = rate * service_s / workers
    return math.inf if rho >= 1 else rho * (service_s / workers) * (1 + cv2) / (2 * (1 - rho))

