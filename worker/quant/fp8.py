"""FP8 (e4m3fn) weights, as vLLM's and DeepSeek-V3's FP8 checkpoints hold them: a
float32 scale per output channel (``fp8``), or per 128x128 block (``fp8-block``:
DeepSeek-V3's ``weight_scale_inv``; kept here as one scale per 128 input features of
each row, so a rank's rows keep their blocks' scales). ``w = e4m3(code) * scale``."""

from __future__ import annotations

import torch

from worker.quant.method import QuantMethod, register
from worker.quant.weight import CodeFormat, QuantizedWeight

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
BLOCK = 128


def quantize_fp8(w: torch.Tensor) -> QuantizedWeight:
    w = w.float()
    scales = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    codes = (w / scales).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(codes.view(torch.uint8), scales, None, None, CodeFormat.E4M3, w.shape[1], w.shape[1],
                           method="fp8")


def quantize_fp8_block(w: torch.Tensor) -> QuantizedWeight:
    out, size = w.shape
    rows = -(-out // BLOCK) * BLOCK
    padded = torch.zeros(rows, size, dtype=torch.float32)
    padded[:out] = w.float()
    amax = padded.view(rows // BLOCK, BLOCK, size // BLOCK, BLOCK).abs().amax(dim=(1, 3))
    block_scales = (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # [rows / 128, in / 128]
    return from_block_scales((w.float() / _spread(block_scales, out)).clamp(-E4M3_MAX, E4M3_MAX)
                             .to(torch.float8_e4m3fn), block_scales)


def from_block_scales(codes: torch.Tensor, block_scales: torch.Tensor, block: int = BLOCK) -> QuantizedWeight:
    """A block-scaled FP8 checkpoint tensor (e4m3 [out, in], float32 [out / block, in / block],
    DeepSeek-V3's ``weight`` and ``weight_scale_inv``) in the row-wise layout."""
    out, size = codes.shape
    scales = block_scales.float().repeat_interleave(block, dim=0)[:out].contiguous()
    return QuantizedWeight(codes.contiguous().view(torch.uint8), scales, None, None, CodeFormat.E4M3, block, size,
                           method="fp8-block")


def _spread(block_scales: torch.Tensor, out: int) -> torch.Tensor:
    return block_scales.repeat_interleave(BLOCK, dim=0)[:out].repeat_interleave(BLOCK, dim=1)


register(QuantMethod("fp8", "FP8 e4m3 weights, a float32 scale per output channel", quantize_fp8, 32),
         QuantMethod("fp8-block", "FP8 e4m3 weights, a float32 scale per 128x128 block", quantize_fp8_block, BLOCK))
