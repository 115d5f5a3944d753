"""oneDNN-packed linear weights on the CPU.

A plain ``F.linear`` lets oneDNN/MKL reorder the weight into its blocked layout on
every call; packing hands it over once at load time instead. Measured here
(``benchmarks/linear_packing.py``): float32 1.1-3x faster at decode and
mixed-batch shapes on AVX2 (LM head, 64 rows x 512 x 32,000: 24 ms -> 15 ms) and
about even for whole-prompt chunks; bf16 on AVX-512 up to 2x at M=1.

Whether a dtype is packed is the platform's decision (``Platform.can_pack``, which
reads the capped ISA level), never an assumption. When oneDNN refuses anyway the
model keeps its plain weights: one warning, no crash. ``KERVAN_WEIGHT_PACKING=off``
turns packing off."""

from __future__ import annotations

import logging

import torch
from torch import nn

from kervan.envs import weight_packing
from worker.platform import current_platform, dtype_name

log = logging.getLogger(__name__)

BATCH_HINT = 64  # the row count oneDNN tunes its layout for: 64 did as well as any other, at 1 to 2,048 rows


def packed_linear(x: torch.Tensor, weight: torch.Tensor | None, packed: torch.Tensor | None,
                  bias: torch.Tensor | None) -> torch.Tensor:
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return nn.functional.linear(x, weight, bias)


def pack_weights(modules: list[nn.Module], dtype: torch.dtype, device: str) -> int:
    """Give each module (with ``weight``, and ``keep_weight`` True where another layer
    shares it) a ``packed_weight`` buffer; the plain weight is dropped unless kept.
    Returns how many were packed."""
    if not modules or weight_packing() == "off" or not current_platform().can_pack(dtype, device):
        return 0
    for count, module in enumerate(modules):
        weight = module.weight.data
        try:
            packed = _reorder(weight, BATCH_HINT)
            if count == 0:  # the first call proves the path runs here, with the right numbers
                _check(weight, packed)
        except RuntimeError as exc:
            log.warning("oneDNN cannot pack %s linear weights on this CPU (%s); using plain linears",
                        dtype_name(dtype), str(exc).splitlines()[0])
            return count
        module.register_buffer("packed_weight", packed, persistent=False)
        if not getattr(module, "keep_weight", False):
            module.register_parameter("weight", None)  # the packed copy replaces it: no double memory
    return len(modules)


def _reorder(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def _check(weight: torch.Tensor, packed: torch.Tensor) -> None:
    probe = torch.linspace(-1, 1, 3 * weight.shape[1]).view(3, -1).to(weight.dtype)
    got = packed_linear(probe, None, packed, None).float()
    want = nn.functional.linear(probe, weight).float()
    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()) + 1e-3):
        raise RuntimeError("packed and plain results differ")
