# mypy: disable-error-code="arg-type,assignment,type-var,union-attr"
"""Which kernel computes a quantized matmul's decode-step calls on this CPU,
chosen by timing them on the model's own weights when it loads.

The candidates:

- ``float``: ``quant_linear.cpp``: the codes decoded in registers to float32 (or bf16
  for ``vdpbf16ps`` on AVX512_BF16) and multiplied with x as it comes;
- ``int8``: ``quant_int8.cpp`` (the weight packed for it: ``QuantizedWeight.int8``,
  ``int8_layout.py``): x quantized per call to int8 by blocks of 32 and the
  codes multiplied as bytes (``vpmaddubsw`` on AVX2, ``vpdpbusd`` with AVX512_VNNI),
  llama.cpp's path. For 4-bit codes with integer values (int4, Q4_0, Q4_1) and int8
  codes (int8, Q8_0); x's rounding to int8 is its only error.

Which is faster depends on the CPU kind (VNNI or not, bf16 dots or not) and the shape,
so ``choose_kernels`` times both on each distinct weight shape at 1 and 8 rows, the
median of alternating rounds, and keeps the faster; the table is logged at start and
exported on the worker's ``/metrics`` (``kervan_quant_kernel_info``).
The LM head's integer candidate is ``int8x2``: x rounded to two int8 terms (x's, and its
remainder's), about 1/127 of int8's error for the same weight bytes. Tokens are chosen from
its logits, and one term moves them enough to flip a near-tie (SmolLM2's answer to "What is
the capital of France?" starts with "The" at p = 0.15; one int8 term in the head alone
turned it into "L'Étoile, la Marseillaise", in the decoder's layers alone it stayed).
``KERVAN_QUANT_ACTIVATIONS=float`` or ``int8`` forces one kernel wherever it applies;
deterministic mode and worker groups do not time (a choice must not change between starts,
nor differ between ranks): they take the integer kernel where it applies. The packed codes
are a second copy of the weight (the first stays for the embedding's rows and for calls
of more rows than ``matmul.quant_linear`` gives the int8 kernel)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from statistics import median

import torch
from torch import nn

from kervan.envs import quant_activations
from worker.kv.memory import in_one_arena
from worker.parallel import get_parallel_state
from worker.quant.int8_layout import code_offset, pack_int8
from worker.quant.weight import QuantizedWeight

log = logging.getLogger(__name__)
TIMED_ROWS = (1, 8)  # a batch-1 decode step, and a small batch
ROUNDS = 5


@dataclass(frozen=True)
class KernelChoice:
    """One distinct quantized weight and the kernel its few-row calls take."""

    out_features: int
    in_features: int
    method: str
    group: int
    kernel: str  # "float", "int8", or "int8x2" (two int8 terms: the LM head)
    reason: str  # "timed", "forced", "deterministic", "worker group", or why int8 does not apply
    float_us: float | None = None  # the timed rows' medians, summed
    int8_us: float | None = None

    def describe(self) -> str:
        timing = (f" (float {self.float_us:.0f} us, int8 {self.int8_us:.0f} us at rows {TIMED_ROWS})"
                  if self.float_us is not None else "")
        return (f"{self.out_features}x{self.in_features} {self.method or 'quantized'}: {self.kernel}, "
                f"{self.reason}{timing}")


def choose_kernels(model: nn.Module, dtype: torch.dtype, deterministic: bool) -> list[KernelChoice]:
    """Pick each quantized weight's kernel and set it on the model (``QuantizedWeight.int8``)."""
    from worker.kernels import has_native_kernels
    from worker.quant.model import quantized_weights

    weights = quantized_weights(model)
    if not weights or not has_native_kernels() or not torch.ops.kervan.int8_instructions():
        return []
    head = getattr(getattr(model, "lm_head", None), "quant", None)
    decided: dict[tuple, KernelChoice] = {}

    def key(w: QuantizedWeight) -> tuple:  # what a choice holds for: the shape and codes, and the head apart
        return (w.out_features, w.in_features, w.method, w.format, w.group, w.scales.dtype, w.zeros is None,
                head is not None and w.codes is head.codes)

    for w in weights:
        if key(w) not in decided:
            decided[key(w)] = _decide(w, dtype, deterministic, is_head=key(w)[-1])
    # by the codes' identity (a tied head and its embedding pack once), in the model's order
    packed = {id(w.codes): _packed(w, decided[key(w)].kernel) for w in weights if decided[key(w)].kernel != "float"}
    packed = dict(zip(packed, in_one_buffer(list(packed.values()))))
    for module in model.modules():
        quant = getattr(module, "quant", None)
        if isinstance(quant, QuantizedWeight):
            module.quant = packed.get(id(quant.codes), quant)
        experts = getattr(module, "expert_quants", None)
        if experts:
            module.expert_quants = [tuple(packed.get(id(q.codes), q) for q in pair) for pair in experts]
    choices = list(decided.values())
    for choice in choices:
        log.info("quantized matmul %s", choice.describe())
    return choices


def in_one_buffer(weights: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """The packed weights moved into one buffer on huge pages, in the order given (the
    model's, which is the order a step reads them): a decode step then streams one region
    front to back, a TLB entry per 2 MiB instead of per 4 KiB (the 30 MB LM head read at
    21 GB/s from 4 KiB pages and 24 from huge ones, measured on the AMX Xeon)."""
    moved = in_one_arena([w.int8.data for w in weights])
    return [replace(w, int8=replace(w.int8, data=data)) for w, data in zip(weights, moved)]


def with_int8(w: QuantizedWeight, terms: int = 1) -> QuantizedWeight:
    """``w`` with its codes packed for this CPU's int8-activation kernel, x rounded to
    ``terms`` int8 terms."""
    from worker.kernels import has_native_kernels
    if not has_native_kernels() or not torch.ops.kervan.int8_instructions():
        raise RuntimeError("the int8-activation kernel needs the native kernels on an AVX2 CPU")
    vnni = torch.ops.kervan.int8_instructions() == "vnni"
    return replace(w, int8=replace(pack_int8(w, tile=16 if vnni else 8, unsigned_int8=vnni), terms=terms))


def _packed(w: QuantizedWeight, kernel: str) -> QuantizedWeight:
    return replace(w, int8=None) if kernel == "float" else with_int8(w, terms=2 if kernel == "int8x2" else 1)


def _decide(w: QuantizedWeight, dtype: torch.dtype, deterministic: bool, is_head: bool) -> KernelChoice:
    base = dict(out_features=w.out_features, in_features=w.in_features, method=w.method, group=w.group)
    if code_offset(w) is None:
        return KernelChoice(**base, kernel="float", reason="int8 activations do not apply to these codes")
    setting = quant_activations()
    if setting != "auto":
        return KernelChoice(**base, kernel=setting, reason="forced")
    integer = "int8x2" if is_head else "int8"  # the head's logits choose tokens: x to two int8 terms
    if deterministic or get_parallel_state().world > 1:  # the same choice at every start, and on every rank
        return KernelChoice(**base, kernel=integer, reason="deterministic" if deterministic else "worker group")
    float_us, int8_us = time_kernels(w, dtype, integer)
    return KernelChoice(**base, kernel=integer if int8_us < float_us else "float", reason="timed",
                        float_us=float_us, int8_us=int8_us)


def time_kernels(w: QuantizedWeight, dtype: torch.dtype, integer: str = "int8") -> tuple[float, float]:
    """Microseconds of the float kernel and ``integer`` ("int8" or "int8x2") on ``w``: per
    timed row count the median of ``ROUNDS`` alternating rounds, summed over the row counts."""
    from worker.quant.matmul import quant_linear

    gen = torch.Generator().manual_seed(0)
    kernels = {"float": _packed(w, "float"), "int8": _packed(w, integer)}
    total = dict.fromkeys(kernels, 0.0)
    for rows in TIMED_ROWS:
        x = torch.randn(rows, w.in_features, generator=gen).to(dtype)
        for q in kernels.values():  # warm: code paths, the weight into cache
            quant_linear(x, q)
        samples: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(ROUNDS):
            for name, q in kernels.items():
                start = time.perf_counter()
                quant_linear(x, q)
                samples[name].append(time.perf_counter() - start)
        for name in kernels:
            total[name] += median(samples[name]) * 1e6
    return total["float"], total["int8"]
