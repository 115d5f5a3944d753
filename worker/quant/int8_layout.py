"""A quantized weight packed for the int8-activation kernel (``quant_int8.cpp``): ``Int8Layout``.

The kernel computes ``tile`` output features at once, one per vector lane (16 with
AVX512_VNNI, 8 with AVX2), so the weight is laid out by tiles of features, each tile one
stream that the kernel reads front to back (a stream per tile, not three: scales, zeros
and codes arrive together, as GGUF's blocks keep them). Per tile, one record per group of
input features::

    scales [tile], zeros' [tile]              zeros' = zero + offset * scale (float32 or 16)
    codes [blocks of the group, steps, tile, 4]
                                              int8 codes: 8 steps of 4 codes a block;
                                              4-bit codes: 4 loads, byte i of feature f in
                                              load l holding codes 4l + i (low nibble) and
                                              16 + 4l + i (high nibble) of the block

Codes are unsigned (4-bit 0..15; int8 shifted by 128 for ``vpdpbusd``, which takes unsigned
bytes) with ``offset`` the value of code 0 folded into the zeros, or signed int8 for AVX2's
``vpmaddubsw`` (where 0..255 codes would saturate its int16 pair sums). Features past
``out_features`` are padding: codes and scales 0. The codes are a second copy of the
weight's bytes: the original stays for the embedding's rows and longer calls. The record itself,
``Int8Layout``, lives beside ``QuantizedWeight`` (``weight.py``), which holds one."""

from __future__ import annotations

import torch

from worker.quant.weight import CodeFormat, Int8Layout, QuantizedWeight


def code_offset(w: QuantizedWeight) -> float | None:
    """The value of code 0 when the int8 kernel can compute ``w`` (4-bit codes standing for
    offset + 0..15, or int8 codes), else None."""
    if w.codes.device.type != "cpu" or w.group % 32 or w.in_features % 32 or w.scales.dtype not in (
            torch.float16, torch.float32):
        return None
    if w.format in (CodeFormat.UINT4, CodeFormat.INT8):
        return 0.0
    if w.format == CodeFormat.LUT4 and w.lut is not None:
        offset = float(w.lut[0])
        if offset == round(offset) and torch.equal(w.lut, torch.arange(16, dtype=w.lut.dtype) + offset):
            return offset
    return None


def pack_int8(w: QuantizedWeight, tile: int, unsigned_int8: bool) -> Int8Layout:
    """``w`` in the kernel's layout for ``tile``-feature tiles (``code_offset(w)`` must not be None)."""
    offset = code_offset(w)
    if offset is None:
        raise ValueError(f"{w.method or w.format.name} codes have no int8-activation kernel")
    n, k = w.out_features, w.in_features
    tiles = -(-n // tile)
    pad = tiles * tile - n
    four_bit = w.is_four_bit
    signed_codes = not four_bit and not unsigned_int8
    if four_bit:
        lo, hi = w.codes & 0x0F, w.codes >> 4  # [n, k / 2]: a block's low nibbles are elements 0-15
        u = torch.cat((lo.view(n, -1, 16), hi.view(n, -1, 16)), -1).view(n, k)
        u = torch.nn.functional.pad(u, (0, 0, 0, pad)).view(tiles, tile, k // 32, 2, 4, 4)
        packed = u[:, :, :, 0] | (u[:, :, :, 1] << 4)  # [tiles, tile, blocks, load, byte]
    else:
        c = w.codes.view(torch.int8)
        if unsigned_int8:
            c = (c.to(torch.int16) + 128).to(torch.uint8)
            offset = -128.0
        packed = torch.nn.functional.pad(c.view(torch.uint8), (0, 0, 0, pad)).view(tiles, tile, k // 32, 8, 4)
    groups = k // w.group
    codes = packed.permute(0, 2, 3, 1, 4).reshape(tiles, groups, -1)  # [tiles, groups, the group's code bytes]
    scales = w.scales.float() * w.tensor_scale
    zeros = offset * scales + (w.zeros.float() if w.zeros is not None else 0.0)
    dtype = w.scales.dtype if w.tensor_scale == 1.0 else torch.float32
    if not torch.equal(zeros.to(dtype).float(), zeros):  # zero + offset * scale not exact in float16
        dtype = torch.float32
    records = torch.cat((_tiled(scales.to(dtype), tile), _tiled(zeros.to(dtype), tile), codes), dim=-1)
    return Int8Layout(records.reshape(tiles, -1).contiguous(), four_bit, signed_codes, dtype == torch.float16)


def _tiled(params: torch.Tensor, tile: int) -> torch.Tensor:
    """[n, groups] -> [tiles, groups, tile * itemsize] bytes, padded features 0."""
    n, groups = params.shape
    pad = -n % tile
    tiled = torch.nn.functional.pad(params, (0, 0, 0, pad)).view(-1, tile, groups).transpose(1, 2).contiguous()
    return tiled.view(torch.uint8)
