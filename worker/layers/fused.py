"""The decoder's element-wise steps, each with two paths: a fused native CPU
kernel (``worker/kernels/fused_ops.cpp``: one pass over each row instead of 4-8
PyTorch ops that each read and write the whole activation) where the kernels are
loaded, and plain PyTorch everywhere else. The PyTorch path is the reference
(Hugging Face's arithmetic); the kernels round to the model dtype at the same
places, and ``tests/worker/test_fused_ops.py`` holds them to it."""

from __future__ import annotations

import torch
from torch import nn

from worker.kernels import has_native_kernels


def is_native(x: torch.Tensor) -> bool:
    return x.is_cpu and has_native_kernels()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [num_tokens, hidden]
    if is_native(x) and x.is_contiguous():
        out = torch.empty_like(x)
        torch.ops.kervan.rms_norm(out, x, weight, eps)
        return out
    return rms_norm_torch(x, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual). The native path overwrites both inputs."""
    if is_native(x) and x.is_contiguous() and residual.is_contiguous():
        torch.ops.kervan.add_rms_norm(x, residual, weight, eps)
        return x, residual
    residual = x + residual
    return rms_norm_torch(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * inter] (gate | up) -> silu(gate) * up, [num_tokens, inter]."""
    if is_native(x) and x.is_contiguous():
        out = x.new_empty(x.shape[0], x.shape[1] // 2)
        torch.ops.kervan.silu_and_mul(out, x)
        return out
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of the first ``cos.shape[-1]`` channels of each head.
    q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim];
    cos, sin: [max_positions, rotary_dim]. The native path rotates q and k in place."""
    if is_native(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
        torch.ops.kervan.rotary(q, k, cos, sin, positions)
        return q, k
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [num_tokens, 1, rotary_dim]
    return _rotate(q, c, s), _rotate(k, c, s)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    rot, keep = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return out if keep.shape[-1] == 0 else torch.cat((out, keep), dim=-1)
