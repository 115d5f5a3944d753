# mypy: disable-error-code="arg-type,index,misc"
"""A weight matrix kept in its low-precision codes: ``QuantizedWeight``.

``[out_features, in_features]`` as codes, one scale per group of ``group`` input
features of each output row, optional zeros, and for 4-bit codes the table of the
16 values a code stands for (layouts in ``worker/kernels/quant_linear.cpp``):

    w[n, k] = value(codes[n, k]) * (scales[n, k // group] * tensor_scale) + zeros[n, k // group]

Every format Kervan serves is this one shape with other tables and dtypes (int8 per
channel, int4 and GGUF's Q4_0/Q4_1/Q8_0 by groups, FP8 e4m3 per channel or 128x128
blocks spread over their rows, NVFP4's 16-element blocks with e4m3 scales), so slicing
for a worker group is one rule: whole rows, or whole groups of columns. A rank keeps its
rows (column-parallel) or its groups (row-parallel) and their scales, never a copy of
the rest."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum

import torch


class CodeFormat(IntEnum):
    """How a code is stored (``quant_linear.cpp``'s enum)."""

    LUT4 = 0  # 4 bits, two per byte (GGUF's order in 32-element blocks), an index into ``lut``
    INT8 = 1  # int8, one per byte
    E4M3 = 2  # float8 e4m3fn bits, one per byte
    UINT4 = 3  # 4 bits as LUT4, standing for 0..15 themselves (int4 with zeros, Q4_1)


@dataclass(frozen=True)
class Int8Layout:
    """A weight's codes packed for the int8-activation kernel (``int8_layout.py`` packs them)."""

    data: torch.Tensor  # uint8 [tiles, bytes]: each tile's records
    four_bit: bool
    signed_codes: bool
    half_params: bool  # scales and zeros in float16, else float32
    terms: int = 1  # x rounded to one int8 term, or two (x and its remainder: the LM head's logits)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass(frozen=True)
class QuantizedWeight:
    codes: torch.Tensor  # uint8 [out, in / 2] (LUT4) or [out, in]
    scales: torch.Tensor  # [out, in / group]: float32, float16 or float8_e4m3fn
    zeros: torch.Tensor | None  # like scales, or None
    lut: torch.Tensor | None  # float32 [16] for LUT4, else None
    format: CodeFormat
    group: int
    in_features: int
    tensor_scale: float = 1.0
    method: str = ""  # the name it was made by, for reports ("int4", "gguf-q4_1", ...)
    # the codes packed for the int8-activation kernel, where it computes this weight's few-row calls
    # (``kernel_choice.py``): made for the whole matrix, so slicing drops it
    int8: Int8Layout | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.in_features))

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    def dim(self) -> int:
        return 2

    @property
    def is_four_bit(self) -> bool:
        return self.format in (CodeFormat.LUT4, CodeFormat.UINT4)

    @property
    def nbytes(self) -> int:
        """Bytes held: codes, scales, zeros (the table and tensor scale are shared constants)."""
        return sum(t.nbytes for t in (self.codes, self.scales, self.zeros) if t is not None)

    def __getitem__(self, index) -> QuantizedWeight:
        """``w[a:b]`` (rows) or ``w[:, a:b]`` (columns, whole groups), as a loader indexes a
        checkpoint tensor; ``w[:]`` is all of it."""
        if not isinstance(index, tuple):
            return self.rows(index)
        rows, cols = index
        return self.rows(rows).columns(cols.start or 0, self.in_features if cols.stop is None else cols.stop)

    def rows(self, index: slice | torch.Tensor) -> QuantizedWeight:
        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index].contiguous()
        return replace(self, codes=take(self.codes), scales=take(self.scales), zeros=take(self.zeros), int8=None)

    def columns(self, start: int, stop: int) -> QuantizedWeight:
        if (start, stop) == (0, self.in_features):
            return self
        block = max(self.group, 32 if self.is_four_bit else 1)
        if start % block or stop % block:
            raise ValueError(f"columns {start}:{stop} split a quantization group of {block}: "
                             "choose a group that divides the shard")
        per = 2 if self.is_four_bit else 1

        def cut(t: torch.Tensor | None, width: int) -> torch.Tensor | None:
            return None if t is None else t[:, start // width:stop // width].contiguous()
        return replace(self, codes=self.codes[:, start // per:stop // per].contiguous(),
                       scales=cut(self.scales, self.group), zeros=cut(self.zeros, self.group),
                       in_features=stop - start, int8=None)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)
        return replace(self, codes=move(self.codes), scales=move(self.scales), zeros=move(self.zeros),
                       lut=move(self.lut), int8=None)

    def values(self) -> torch.Tensor:
        """The codes' values, float32 [out, in], before scaling."""
        if self.is_four_bit:
            lo, hi = self.codes & 0x0F, self.codes >> 4
            # a 32-element block is 16 bytes: low nibbles are elements 0-15, high ones 16-31
            blocks = torch.cat((lo.view(-1, self.in_features // 32, 16), hi.view(-1, self.in_features // 32, 16)), -1)
            codes = blocks.reshape(-1, self.in_features)
            return self.lut[codes.long()] if self.format == CodeFormat.LUT4 else codes.float()
        if self.format == CodeFormat.INT8:
            return self.codes.view(torch.int8).float()
        return self.codes.view(torch.float8_e4m3fn).float()

    def reference_dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Plain PyTorch, the definition the kernels reproduce bit for bit: float32
        multiply, then add, then one rounding to ``dtype``."""
        scales = self.scales.float()
        if self.tensor_scale != 1.0:
            scales = scales * self.tensor_scale
        w = self.values() * scales.repeat_interleave(self.group, dim=1)
        if self.zeros is not None:
            w = w + self.zeros.float().repeat_interleave(self.group, dim=1)
        return w.to(dtype)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes [out, in] (0..15, any integer dtype) -> uint8 [out, in / 2] in GGUF's
    block order (``values``' inverse)."""
    blocks = q.to(torch.uint8).view(q.shape[0], -1, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(q.shape[0], -1).contiguous()


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Parts of one matmul stacked by rows (q/k/v, gate/up): one format and group."""
    first = parts[0]
    if any((p.format, p.group, p.in_features, p.tensor_scale, p.scales.dtype, p.zeros is None)
           != (first.format, first.group, first.in_features, first.tensor_scale, first.scales.dtype,
               first.zeros is None) or (p.lut is not None and not torch.equal(p.lut, first.lut)) for p in parts):
        raise ValueError("the parts of a merged linear are quantized differently")
    return replace(first, codes=torch.cat([p.codes for p in parts]), scales=torch.cat([p.scales for p in parts]),
                   zeros=None if first.zeros is None else torch.cat([p.zeros for p in parts]), int8=None)
