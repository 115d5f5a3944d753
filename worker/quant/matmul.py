"""``x @ w.T`` for a ``QuantizedWeight`` w, activations in the model's dtype.

On the CPU with the native kernels every call of a weight takes one kernel, whatever its row
count, and both compute each row alone (a token's result never depends on the rest of its
call: the batch, its prompt's chunk, a cached prefix):

- ``quant_matmul_i8`` where the weight has its int8 layout (``kernel_choice.py``: integer
  codes, int4, Q4_0, Q4_1, int8, Q8_0, on a CPU with AVX2): each row of x rounded to one or
  two int8 terms (two by default) by blocks of 32 and the codes multiplied as bytes, llama.cpp's
  path; calls of many rows on AMX tiles, with the same bits;
- else ``quant_matmul``: each row of codes decoded in registers and dotted with every row of
  x, summing in float32 (bf16 x on AVX512_BF16: bf16 values and ``vdpbf16ps``).

Where the native kernels are absent (a build failed, a CUDA device) tiles of ``TILE_ELEMENTS``
weights are dequantized to x's dtype and go through that dtype's own matmul (cuBLAS, or
PyTorch's CPU reference): not batch-invariant. FP8 on a GPU with FP8 tensor cores takes
``torch._scaled_mm`` (``fp8_scaled_mm``).

``benchmarks/quant_kernels.py`` measures PyTorch's own int8/int4 CPU kernels
(``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) against these on the real
model's shapes (``benchmarks/README.md``)."""

from __future__ import annotations

import torch

from worker.kernels import has_native_kernels
from worker.quant.weight import CodeFormat, QuantizedWeight

TILE_ELEMENTS = 1 << 20  # weights per dequantized tile: 2 MB in bf16, within L2 next to its outputs


def quant_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [rows, in_features] -> [rows, out_features] in x's dtype."""
    if x.device.type == "cpu" and has_native_kernels():
        x = x if x.stride(-1) == 1 else x.contiguous()
        packed = w.int8
        if packed is not None:
            return torch.ops.kervan.quant_matmul_i8(x, packed.data, w.out_features, w.group, packed.four_bit,
                                                    packed.signed_codes, packed.half_params, packed.terms, bias)
        return torch.ops.kervan.quant_matmul(x, w.codes, w.scales, w.zeros, w.lut, int(w.format), w.group,
                                             w.tensor_scale, bias)
    if x.device.type == "cuda" and w.format == CodeFormat.E4M3 and has_fp8_tensor_cores(x.device):
        return fp8_scaled_mm(x, w, bias)
    return tiled_linear(x, w, bias)


def dequantize(w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """All of ``w`` in ``dtype`` (the kernel where it is loaded, else the reference)."""
    if w.codes.device.type == "cpu" and has_native_kernels():
        return torch.ops.kervan.quant_dequantize(w.codes, w.scales, w.zeros, w.lut, int(w.format), w.group,
                                                 w.tensor_scale, dtype)
    return w.reference_dequantize(dtype)


def tiled_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    step = max(1, TILE_ELEMENTS // w.in_features)
    parts = [torch.nn.functional.linear(x, dequantize(w.rows(slice(n, n + step)), x.dtype))
             for n in range(0, w.out_features, step)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return out if bias is None else out + bias


def has_fp8_tensor_cores(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)  # Ada, Hopper, Blackwell


def fp8_scaled_mm(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """FP8 tensor cores through ``torch._scaled_mm``: x quantized per token to e4m3 (its
    rows' absolute maxima over 448, vLLM's dynamic per-token scheme), the weight's per-row
    scales (per-channel FP8 only: block scales vary along K, which ``_scaled_mm``'s
    row-wise mode cannot express; those take the tiles). PyTorch runs this on the CPU
    too, which is how the tests check it where no GPU is."""
    if w.scales.shape[1] != 1:
        return tiled_linear(x, w, bias)
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    x_scale = amax / torch.finfo(torch.float8_e4m3fn).max
    x8 = (x.float() / x_scale).to(torch.float8_e4m3fn)
    w_scale = w.scales.float().view(1, -1) * w.tensor_scale
    out = torch._scaled_mm(x8, w.codes.view(torch.float8_e4m3fn).t(), scale_a=x_scale, scale_b=w_scale,
                           out_dtype=x.dtype if x.dtype != torch.float32 else torch.bfloat16)
    out = out.to(x.dtype)
    return out if bias is None else out + bias
