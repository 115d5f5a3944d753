"""Pre-quantized FP8 safetensors checkpoints, read as vLLM reads them.

Two ``quantization_config``s in ``config.json`` hold FP8 weights:
- ``"quant_method": "compressed-tensors"`` with ``"format": "float-quantized"`` (llm-compressor's
  FP8 and FP8-dynamic schemes): ``*.weight`` in float8_e4m3fn beside ``*.weight_scale``, one
  per tensor or one per output channel;
- ``"quant_method": "fp8"`` (Hugging Face's, DeepSeek-V3's): ``*.weight`` beside a per-tensor
  ``*.weight_scale``, or with ``"weight_block_size": [128, 128]`` a ``*.weight_scale_inv`` per
  128x128 block.

Each such weight becomes a ``QuantizedWeight`` of its own codes and scales (e4m3 codes, the
scale spread over its rows: ``w = code * scale``), read only as far as a rank's slice goes.
Activation scales (``input_scale``, static FP8 activations) are not used: Kervan's
activations stay in the model's dtype, as vLLM's dynamic scheme does on hardware without
FP8 matmuls. Experts of a mixture-of-experts checkpoint are not read pre-quantized (a
ConfigError says so); ``--quantization fp8`` quantizes a float one at load instead."""

from __future__ import annotations

import torch

from worker.config import ConfigError
from worker.quant.weight import CodeFormat, QuantizedWeight

SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
IGNORED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".output_scale")


def fp8_block(config: dict) -> int | None:
    """The checkpoint's FP8 layout from its ``quantization_config``: None for a float
    checkpoint, 0 for per-tensor or per-channel scales, else the block size of block
    scales. ConfigError for any other quantized checkpoint."""
    q = config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size")
        if block and (len(block) != 2 or block[0] != block[1]):
            raise ConfigError(f"FP8 blocks of {block}: Kervan reads square blocks")
        return int(block[0]) if block else 0
    if method == "compressed-tensors":
        if q.get("format") != "float-quantized":
            raise ConfigError(f"compressed-tensors format {q.get('format')!r}: Kervan reads 'float-quantized' "
                              "(FP8) checkpoints")
        for name, group in (q.get("config_groups") or {}).items():
            w = group.get("weights") or {}
            if w.get("num_bits") != 8 or w.get("type") != "float":
                raise ConfigError(f"compressed-tensors group {name}: weights of {w.get('num_bits')} bits, "
                                  f"{w.get('type')}; Kervan reads 8-bit float (FP8)")
            if w.get("strategy") == "block":
                return int((w.get("block_structure") or [128])[0])
        return 0
    raise ConfigError(f"quantization_config {method!r}: Kervan reads GGUF, FP8 safetensors "
                      "(compressed-tensors float-quantized, or quant_method fp8) and float checkpoints")


class Fp8Tensor:
    """One FP8 weight and its scale, read only as far as it is indexed (``t[a:b]`` rows,
    ``t[:, a:b]`` columns, within whole blocks where the scales are blocks)."""

    def __init__(self, name: str, view, scale: torch.Tensor, block: int):
        self.name, self._view, self._block = name, view, block
        self.shape = torch.Size(view.get_shape())
        if ".experts." in name:
            raise ConfigError(f"{name}: Kervan does not read pre-quantized experts yet; load the float "
                              "checkpoint with --quantization fp8")
        out, size = self.shape
        if scale.numel() == 1:
            scale = scale.reshape(1, 1).expand(out, 1)
        elif block:
            if tuple(scale.shape) != (-(-out // block), -(-size // block)):
                raise ConfigError(f"{name}: block scales {tuple(scale.shape)} do not fit {out} x {size} "
                                  f"in blocks of {block}")
            scale = scale.repeat_interleave(block, dim=0)[:out]
        else:
            scale = scale.reshape(out, 1)
        self._scale = scale.float()

    def dim(self) -> int:
        return 2

    def __getitem__(self, index) -> QuantizedWeight:
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        start, stop = cols.start or 0, self.shape[1] if cols.stop is None else cols.stop
        if (stop - start) % 32:
            raise ConfigError(f"{self.name}: a slice of {stop - start} columns; the quantized matmul takes "
                              "multiples of 32 (a smaller tensor-parallel size would divide it)")
        codes = self._view[rows, start:stop] if (start, stop) != (0, self.shape[1]) else self._view[rows]
        if codes.dtype != torch.float8_e4m3fn:
            raise ConfigError(f"{self.name} is {codes.dtype}; an FP8 checkpoint's weights are float8_e4m3fn")
        scales, group = self._scale[rows], stop - start
        if self._block:
            if start % self._block or (stop - start) % self._block:
                raise ConfigError(f"{self.name}: columns {start}:{stop} are not whole {self._block}-wide FP8 blocks")
            scales, group = scales[:, start // self._block:stop // self._block], self._block
        return QuantizedWeight(codes.contiguous().view(torch.uint8), scales.contiguous(), None, None,
                               CodeFormat.E4M3, group, stop - start, method="fp8-checkpoint")
