"""int8 weight-only, symmetric, one float32 scale per output channel (as PyTorch's
``_weight_int8pack_mm`` and vLLM's W8A16 keep them): ``w = code * amax_row / 127``."""

from __future__ import annotations

import torch

from worker.quant.method import QuantMethod, register
from worker.quant.weight import CodeFormat, QuantizedWeight


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    w = w.float()
    scales = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round(w / scales).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(codes.view(torch.uint8), scales, None, None, CodeFormat.INT8, w.shape[1], w.shape[1],
                           method="int8")


register(QuantMethod("int8", "int8 weights, a float32 scale per output channel", quantize_int8, 32))
