# mypy: disable-error-code="arg-type,index,misc"
"""Packed linear weights on the CPU, in one of two layouts.

- oneDNN's (``mkldnn::_linear_pointwise``): a plain ``F.linear`` lets oneDNN/MKL
  reorder the weight into its blocked layout on every call; packing hands it over
  once at load time instead. Measured here (``benchmarks/linear_packing.py``):
  float32 1.1-3x faster at decode and mixed-batch shapes on AVX2 (LM head, 64 rows x
  512 x 32,000: 24 ms -> 15 ms) and about even for whole-prompt chunks; bf16 on
  AVX-512 up to 2x at M=1.
- brgemm's (``worker/kernels/linear.cpp``): oneDNN's micro-kernel
  (AMX) behind one parallel region per call, where oneDNN packs the dtype for it (bf16
  with AMX): a call costs a fraction of oneDNN linear's fixed cost, which a decode step
  of a deep, narrow model pays hundreds of times. Kept beside oneDNN's layout
  (``brgemm_weight``) for the decoder's linears whose output features are a multiple of
  32, while they fit ``BRGEMM_BUDGET_BYTES``, and taken by calls of at most
  ``BRGEMM_MAX_ROWS`` rows; long prompt chunks and the LM head (wide: the fixed cost
  vanishes, and oneDNN's blocking wins) take oneDNN's. The brgemm copies sit side by side
  on huge pages in the order a step reads them (``kv.memory.in_one_arena``: SmolLM2's bf16
  layers in a decode step 9.5 -> 8.7 ms on the AMX Xeon).
- gemv's (``worker/kernels/gemv.cpp``), float32 only: column blocks of 32, each [K, 32]
  contiguous, for calls of at most ``GEMV_MAX_ROWS`` rows outside deterministic mode, the LM
  head's included; under the same budget as brgemm's (it is a second copy too).

Whether a dtype is packed is the platform's decision (``Platform.can_pack``, which
reads the capped ISA level), never an assumption. When oneDNN refuses anyway the
model keeps its plain weights: one warning, no crash. ``KERVAN_WEIGHT_PACKING``:
``auto`` (the above), ``onednn`` (oneDNN's layout only), ``off``."""

from __future__ import annotations

import logging

import torch
from torch import nn

from kervan.envs import weight_packing
from worker.kernels import has_native_kernels
from worker.kv.memory import in_one_arena
from worker.layers.batch_invariant import RowPlan
from worker.platform import current_platform, dtype_name

log = logging.getLogger(__name__)

BRGEMM_BLOCK_N = 32  # the brgemm layout's column block (``linear.cpp``)
# calls of up to this many rows take the brgemm layout (decode batches, short chunks): above it
# oneDNN's linear is as fast or faster (2,048-row prompt chunks: 1.4x), its fixed cost spread
# over the rows (``benchmarks/linear_kernels.py``)
BRGEMM_MAX_ROWS = 256
# the brgemm layout is a second copy of the decoder's linear weights: kept while they are small,
# where a step is many small calls (SmolLM2-135M: 212 MB in bf16); a larger model's calls are
# long enough that oneDNN's fixed cost no longer counts
BRGEMM_BUDGET_BYTES = 1 << 30
BATCH_HINT = 64  # the row count oneDNN tunes its layout for: 64 did as well as any other, at 1 to 2,048 rows
# float32 calls of up to this many rows take the gemv layout (``worker/kernels/gemv.cpp``): oneDNN's
# float32 linear took 1.2-1.4x its time on SmolLM2's MLP shapes at 1 to 8 rows, 1.0 at 16 (capped
# to AVX2 on the AMX Xeon)
GEMV_MAX_ROWS = 8
GEMV_BLOCK_N = 32  # gemv.cpp's column block


def packed_linear(x: torch.Tensor, weight: torch.Tensor | None, packed: torch.Tensor | None,
                  bias: torch.Tensor | None, row_plan: RowPlan | None = None,
                  small: torch.Tensor | None = None, gemv: torch.Tensor | None = None) -> torch.Tensor:
    """x: [rows, in_features]. ``small``: the brgemm layout, taken for calls of at most
    ``BRGEMM_MAX_ROWS`` rows; ``gemv``: the float32 blocked layout, for calls of at most
    ``GEMV_MAX_ROWS`` rows, and never under a row plan (its sums run in another order than
    oneDNN's). With a ``row_plan``, batch-invariant: as calls of the row counts it allows
    (``batch_invariant.py``)."""
    if row_plan is not None:
        return row_plan.run(lambda rows: packed_linear(rows, weight, packed, bias, None, small), x)
    if gemv is not None and x.shape[0] <= GEMV_MAX_ROWS:
        return torch.ops.kervan.gemv_linear(x, gemv, bias)
    if small is not None and x.shape[0] <= BRGEMM_MAX_ROWS:
        return torch.ops.kervan.brgemm_linear(x, small, bias)
    if packed is None:
        return nn.functional.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_weights(modules: list[nn.Module], dtype: torch.dtype, device: str, wide: nn.Module | None = None) -> int:
    """Give each module (with ``weight``, and ``keep_weight`` True where another layer
    shares it) a ``packed_weight`` in oneDNN's layout; the plain weight is dropped unless
    kept. Where brgemm packs the dtype and the decoder's linears fit ``BRGEMM_BUDGET_BYTES``,
    each but ``wide`` (the LM head) also gets a ``brgemm_weight``. Returns how many were packed."""
    if not modules or weight_packing() == "off" or not current_platform().can_pack(dtype, device):
        return 0
    narrow = [m for m in modules if m is not wide and m.weight.shape[0] % BRGEMM_BLOCK_N == 0
              and m.weight.shape[1] % 2 == 0]  # whole column blocks, pairs of K
    within_budget = weight_packing() == "auto" and sum(m.weight.nbytes for m in narrow) <= BRGEMM_BUDGET_BYTES
    use_brgemm = within_budget and brgemm_packs(dtype)
    # gemv's layout for the head too (its 32-column blocks suit a wide matrix as well): SmolLM2's float32 head
    # took 5.3 ms a batch-1 step through oneDNN, capped to AVX2
    gemv = [m for m in modules if m.weight.shape[0] % GEMV_BLOCK_N == 0]
    use_gemv = (weight_packing() == "auto" and dtype == torch.float32 and has_native_kernels()
                and sum(m.weight.nbytes for m in gemv) <= BRGEMM_BUDGET_BYTES)
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
        if use_brgemm and module in narrow:
            use_brgemm = _add_brgemm(module, weight, check=module is narrow[0])
        if use_gemv and module in gemv:
            module.gemv_weight = torch.ops.kervan.pack_gemv(weight)
        module.packed_weight = packed  # a plain attribute (class default None): read on every call, no module lookup
        if not getattr(module, "keep_weight", False):
            module.register_parameter("weight", None)  # the packed copy replaces it: no double memory
    for name in ("brgemm_weight", "gemv_weight"):
        small = [m for m in modules if getattr(m, name, None) is not None]
        for module, moved in zip(small, in_one_arena([getattr(m, name) for m in small])):
            setattr(module, name, moved)
    return len(modules)


def _add_brgemm(module: nn.Module, weight: torch.Tensor, check: bool) -> bool:
    """Give ``module`` its brgemm layout (``check``: prove the path on it first); False,
    after one warning, where brgemm refuses."""
    try:
        small = torch.ops.kervan.pack_linear(weight)
        if check:
            _check(weight, small)
    except RuntimeError as exc:
        log.warning("oneDNN's micro-kernel cannot pack these linear weights (%s); small batches use oneDNN's "
                    "linear", str(exc).splitlines()[0])
        return False
    module.brgemm_weight = small
    return True


def brgemm_packs(dtype: torch.dtype) -> bool:
    """Whether the brgemm layout serves ``dtype`` here: the native kernels are loaded and
    oneDNN's micro-kernel packs it on this CPU (bf16 with AMX; it reads oneDNN's ISA cap)."""
    return has_native_kernels() and torch.ops.kervan.brgemm_packs(dtype)


def _reorder(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def _check(weight: torch.Tensor, packed: torch.Tensor) -> None:
    """``packed`` (oneDNN's layout, or brgemm's: 3-D) computes what ``weight`` does."""
    probe = torch.linspace(-1, 1, 3 * weight.shape[1]).view(3, -1).to(weight.dtype)
    small = packed if packed.dim() == 3 else None
    got = packed_linear(probe, None, None if small is not None else packed, None, None, small).float()
    want = nn.functional.linear(probe, weight).float()
    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()) + 1e-3):
        raise RuntimeError("packed and plain results differ")
