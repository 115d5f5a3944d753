"""SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` with gate and up merged
into one column-parallel matmul and down row-parallel."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from worker.layers.fused import silu_and_mul
from worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear

Loader = Callable[[torch.Tensor], None]


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.gate_up = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, False, dtype)
        self.down = RowParallelLinear(intermediate_size, hidden_size, False, dtype)

    def loaders(self, prefix: str) -> dict[str, Loader]:
        return {
            f"{prefix}gate_proj.weight": lambda t: self.gate_up.load(0, t),
            f"{prefix}up_proj.weight": lambda t: self.gate_up.load(1, t),
            f"{prefix}down_proj.weight": self.down.load,
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down.forward(silu_and_mul(self.gate_up.forward(x)))  # forward: see DecoderModel.forward
