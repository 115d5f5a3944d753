"""RMSNorm, computed in float32 and cast back, as Hugging Face does; with a
residual it first adds it (``x + residual``) and returns the sum too, so a fused
kernel can do both in one pass (``worker/layers/fused.py``)."""

from __future__ import annotations

import torch
from torch import nn

from worker.layers.fused import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # x, residual: [num_tokens, hidden]
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
