# mypy: disable-error-code="arg-type,assignment,index,misc,union-attr"
"""Linear weights packed on the CPU, in the one layout every call of a layer takes.

A token's row must come out of a linear with the same bits whatever else is in the call:
the other sequences of a batch, the rest of its prompt's chunk, or nothing, when its
prefix came from the cache or another worker. oneDNN and MKL pick a matmul's blocking
from its shape, so the same row rounds differently at 1, 37 or 2,048 rows, and a near-tie
of greedy decoding flips (the same question asked twice gets two answers). So by default
each float linear gets one layout whose kernel computes a row alone, at every row count:

- ``BRGEMM`` (``worker/kernels/linear.cpp``): oneDNN's micro-kernel, AMX tiles, where it
  packs the dtype (bf16 and fp16 on AMX CPUs), for output features a multiple of 32;
- ``INVARIANT`` (``worker/kernels/invariant_linear.cpp``): one float32 FMA chain per output
  element in k order, for every other float weight (float32 everywhere, bf16 without AMX).

``ONEDNN`` (``mkldnn::_linear_pointwise``, the layout handed to oneDNN once at load) is the
fallback where the native kernels are absent, and ``KERVAN_WEIGHT_PACKING=onednn`` asks for
it (a baseline for benchmarks): faster than a plain ``F.linear``, not batch-invariant.
``KERVAN_WEIGHT_PACKING=off`` keeps plain weights. The packed copies replace the weights
(a tied head keeps its embedding's rows) and sit side by side on huge pages in the order a
step reads them. Whether oneDNN packs a dtype is the platform's decision
(``Platform.can_pack``); when a kernel refuses anyway the model keeps its plain weights: one
warning, no crash."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import torch
from torch import nn

from kervan.envs import weight_packing
from worker.kernels import has_native_kernels
from worker.kv.memory import in_one_arena
from worker.platform import current_platform, dtype_name

log = logging.getLogger(__name__)

BRGEMM_BLOCK_N = 32  # the brgemm layout's column block (``linear.cpp``)
BATCH_HINT = 64  # the row count oneDNN tunes its layout for: 64 did as well as any other, at 1 to 2,048 rows


class PackKind(enum.Enum):
    BRGEMM = "brgemm"
    INVARIANT = "invariant"
    ONEDNN = "onednn"


@dataclass(frozen=True)
class PackedLinear:
    """A linear's weight in one kernel's layout; ``out_features`` may be fewer than the
    layout's columns (the invariant layout pads to whole blocks)."""

    kind: PackKind
    data: torch.Tensor
    out_features: int

    @property
    def is_batch_invariant(self) -> bool:
        return self.kind != PackKind.ONEDNN


def packed_linear(x: torch.Tensor, weight: torch.Tensor | None, packed: PackedLinear | None,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x: [rows, in_features] -> [rows, out_features] through ``packed``, else ``weight``."""
    if packed is None:
        return nn.functional.linear(x, weight, bias)
    if packed.kind == PackKind.ONEDNN:
        return torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")
    x = x if x.stride(-1) == 1 else x.contiguous()
    if packed.kind == PackKind.BRGEMM:
        return torch.ops.kervan.brgemm_linear(x, packed.data, bias)
    return torch.ops.kervan.invariant_linear(x, packed.data, packed.out_features, bias)


def pack_weights(modules: list[nn.Module], dtype: torch.dtype, device: str) -> int:
    """Give each module (with ``weight``, and ``keep_weight`` True where another layer
    shares it) its ``packed`` layout; the plain weight is dropped unless kept. Returns how
    many were packed."""
    if not modules or device != "cpu" or weight_packing() == "off":
        return 0
    invariant = packs_invariant(device)
    if not invariant and not current_platform().can_pack(dtype, device):
        return 0
    checked: set[PackKind] = set()
    for count, module in enumerate(modules):
        weight = module.weight.data
        try:
            packed = pack_invariant(weight) if invariant else PackedLinear(
                PackKind.ONEDNN, torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT), weight.shape[0])
            if packed.kind not in checked:  # the first of each kind proves its path runs here, with the right numbers
                _check(weight, packed)
                checked.add(packed.kind)
        except RuntimeError as exc:
            log.warning("%s linear weights cannot be packed on this CPU (%s); using plain linears",
                        dtype_name(dtype), str(exc).splitlines()[0])
            return count
        module.packed = packed  # a plain attribute (class default None): read on every call, no module lookup
        if not getattr(module, "keep_weight", False):
            module.register_parameter("weight", None)  # the packed copy replaces it: no double memory
    if invariant:
        arena = in_one_arena([m.packed.data for m in modules])
        for module, data in zip(modules, arena):
            module.packed = PackedLinear(module.packed.kind, data, module.packed.out_features)
    return len(modules)


def packs_invariant(device: str) -> bool:
    """Whether the loader gives weights on ``device`` batch-invariant layouts (the default on
    the CPU with the native kernels)."""
    return device == "cpu" and weight_packing() == "auto" and has_native_kernels()


def pack_invariant(weight: torch.Tensor) -> PackedLinear:
    """``weight`` [out, in] in its batch-invariant layout (the native kernels must be loaded)."""
    return pack_as(PackKind.BRGEMM if brgemm_fits(weight) else PackKind.INVARIANT, weight)


def brgemm_fits(weight: torch.Tensor) -> bool:
    """Whether oneDNN's micro-kernel takes ``weight`` [out, in] here (its dtype and shape)."""
    n, k = weight.shape
    return brgemm_packs(weight.dtype) and n % BRGEMM_BLOCK_N == 0 and k % 2 == 0


def pack_as(kind: PackKind, weight: torch.Tensor) -> PackedLinear:
    """``weight`` [out, in] in a batch-invariant layout: BRGEMM (where ``brgemm_fits``) or INVARIANT."""
    op = torch.ops.kervan.pack_linear if kind == PackKind.BRGEMM else torch.ops.kervan.pack_invariant
    return PackedLinear(kind, op(weight), weight.shape[0])


def brgemm_packs(dtype: torch.dtype) -> bool:
    """Whether the brgemm layout serves ``dtype`` here: the native kernels are loaded and
    oneDNN's micro-kernel packs it on this CPU (bf16 with AMX; it reads oneDNN's ISA cap)."""
    return has_native_kernels() and torch.ops.kervan.brgemm_packs(dtype)


def _check(weight: torch.Tensor, packed: PackedLinear) -> None:
    """``packed`` computes what ``weight`` does."""
    probe = torch.linspace(-1, 1, 3 * weight.shape[1]).view(3, -1).to(weight.dtype)
    got = packed_linear(probe, None, packed, None).float()
    want = nn.functional.linear(probe, weight).float()
    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()) + 1e-3):
        raise RuntimeError(f"{packed.kind.value}-packed and plain results differ")
