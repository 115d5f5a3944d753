"""int4 weight-only, asymmetric by groups of 32, 64 or 128 input features, with a
float16 scale and zero per group (GPTQ/AWQ's and PyTorch's int4 layout, round to
nearest): ``w = code * scale + zero`` with codes 0..15 from each group's minimum to
its maximum. Bytes per weight: 0.5 + 4 / group (64: 0.56, 0.28x of bf16)."""

from __future__ import annotations

import functools

import torch

from worker.quant.method import QuantMethod, register
from worker.quant.weight import CodeFormat, QuantizedWeight, pack_nibbles


def quantize_int4(w: torch.Tensor, group: int) -> QuantizedWeight:
    out, size = w.shape
    g = w.float().view(out, size // group, group)
    low, high = g.amin(dim=-1), g.amax(dim=-1)
    scales = ((high - low) / 15).to(torch.float16)
    zeros = low.to(torch.float16)
    step = scales.float().clamp(min=torch.finfo(torch.float16).tiny).unsqueeze(-1)  # a constant group: codes 0
    codes = torch.round((g - zeros.float().unsqueeze(-1)) / step).clamp(0, 15).view(out, size)
    return QuantizedWeight(pack_nibbles(codes), scales, zeros, None, CodeFormat.UINT4, group, size,
                           method=f"int4-g{group}")


register(*[QuantMethod(name, f"int4 weights, groups of {group} with float16 scales and zeros",
                       functools.partial(quantize_int4, group=group), max(group, 32))
           for name, group in (("int4", 64), ("int4-g32", 32), ("int4-g128", 128))])
