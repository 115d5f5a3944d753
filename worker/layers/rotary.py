"""Rotary position embedding (rotate-half convention), with Llama-3, linear and YaRN
frequency scaling (YaRN's as transformers computes it, DeepSeek-V2/V3's) and partial
rotation (only the first ``rotary_dim`` channels of each head turn, as in GLM-4.5). cos/sin
are computed in float32 for every position once, then cast to the model dtype, matching
Hugging Face."""

from __future__ import annotations

import math

import torch
from torch import nn

from worker.config import RopeConfig
from worker.layers.fused import rotary


def inverse_frequencies(rope: RopeConfig) -> torch.Tensor:
    dim = rope.rotary_dim
    inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.scaling_type == "linear":
        return inv / rope.factor
    if rope.scaling_type == "yarn":
        return yarn_frequencies(rope, inv)
    if rope.scaling_type != "llama3":
        return inv
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_frequencies(rope: RopeConfig, inv: torch.Tensor) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context
    interpolated (divided by ``factor``), more than ``beta_fast`` times kept, a linear ramp between."""
    dim = rope.rotary_dim

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))
    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolated = 1 - ramp
    return inv / rope.factor * (1 - extrapolated) + inv * extrapolated


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def magnitude(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor, else 1."""
    if rope.scaling_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # buffers: [max_positions, rotary_dim] in the model's dtype
    sin: torch.Tensor

    def __init__(self, rope: RopeConfig, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.rotary_dim = rope.rotary_dim
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inverse_frequencies(rope)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rotary_dim]
        scale = magnitude(rope)
        self.register_buffer("cos", (emb.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]
        return rotary(positions, q, k, self.cos, self.sin)
