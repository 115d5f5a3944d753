"""NVFP4-style micro-blocks (NVIDIA's format for Blackwell's FP4 tensor cores): e2m1
values (1 sign, 2 exponent, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6), one e4m3 scale
per 16 consecutive input features and one float32 scale per tensor, as ModelOpt's NVFP4
checkpoints store them (``weight_scale``, ``weight_scale_2``):

    w = e2m1(code) * (e4m3(block_scale) * tensor_scale)

Emulated exactly on any device: the 4-bit codes are looked up in a 16-entry table
inside the matmul, block by block. 0.5 + 1/16 bytes per weight (0.28x of bf16)."""

from __future__ import annotations

import torch

from worker.quant.method import QuantMethod, register
from worker.quant.weight import CodeFormat, QuantizedWeight, pack_nibbles

E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_VALUES = torch.cat((E2M1_MAGNITUDES, -E2M1_MAGNITUDES))  # code = sign << 3 | magnitude index
BLOCK = 16
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def quantize_nvfp4(w: torch.Tensor) -> QuantizedWeight:
    out, size = w.shape
    w = w.float()
    tensor_scale = max(float(w.abs().max()) / (E2M1_MAGNITUDES[-1].item() * E4M3_MAX), 1e-30)
    blocks = w.view(out, size // BLOCK, BLOCK)
    block_scales = (blocks.abs().amax(dim=-1) / 6 / tensor_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    step = (block_scales.float() * tensor_scale).clamp(min=1e-30).unsqueeze(-1)
    scaled = (blocks / step).view(out, size)
    return QuantizedWeight(pack_nibbles(encode_e2m1(scaled)), block_scales, None, E2M1_VALUES.clone(),
                           CodeFormat.LUT4, BLOCK, size, tensor_scale, method="nvfp4")


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (ties to the even mantissa, as the hardware's
    conversion does) -> codes 0..15."""
    mid = (E2M1_MAGNITUDES[1:] + E2M1_MAGNITUDES[:-1]) / 2  # 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5
    mag = x.abs().clamp(max=6)
    index = torch.bucketize(mag, mid)  # a tie rounds down here ...
    tie_up = torch.isin(mag, mid[[1, 3, 5]])  # ... and up where the upper neighbour's mantissa is even
    index = index + tie_up.long()
    return index | (x < 0).long() << 3


register(QuantMethod("nvfp4", "NVFP4-style: e2m1 values, an e4m3 scale per 16, a float32 tensor scale",
                     quantize_nvfp4, 32))
