# mypy: disable-error-code="arg-type,assignment,type-var,union-attr"
"""Which kernel computes a quantized weight's matmuls on this CPU: one per weight, for every
call whatever its row count, the same in every process of this CPU kind.

The candidates:

- ``float``: ``quant_linear.cpp``: the codes decoded in registers to float32 (or bf16
  for ``vdpbf16ps`` on AVX512_BF16) and multiplied with x as it comes;
- ``int8``: ``quant_int8.cpp`` (the weight packed for it: ``QuantizedWeight.int8``,
  ``int8_layout.py``): x quantized per call to int8 by blocks of 32 and the
  codes multiplied as bytes (``vpmaddubsw`` on AVX2, ``vpdpbusd`` with AVX512_VNNI),
  llama.cpp's path. For 4-bit codes with integer values (int4, Q4_0, Q4_1) and int8
  codes (int8, Q8_0); x's rounding to int8 is its only error.

Both compute each row alone, so a token's result is the same in a decode step, in a
prompt's chunk, or after its prefix came from the cache; what must never happen is two
kernels for one weight (the int8 one for a few rows, the float one for many), which rounded a
cached prompt's tail otherwise than the same tokens computed cold and flipped a near-tie
(issue 66: "What is the capital of France?" answered right once and wrong after). The
choice is not timed: the processes of a mesh (a prefill worker and the decode worker it hands
KV to) must make the same one.

The default (``KERVAN_QUANT_ACTIVATIONS=auto``) is ``int8x2`` wherever the codes allow: x
rounded to two int8 terms, its own and its remainder's, about 1/127 of one term's error for
the same weight bytes. Measured on SmolLM2's GGUF against the model's float32 answer
(``benchmarks/quant_activations.py``, ``docs/models.md``), one term (llama.cpp's rounding)
changed the first token of about one answer in ten and SmolLM2's answer to "What is the
capital of France?" ("The" at p = 0.15 became "L'Étoile, la Marseillaise"); two terms kept
the float kernel's answers at about the float kernel's perplexity, for the speed given there.
``KERVAN_QUANT_ACTIVATIONS=int8`` takes one term (the LM head keeps two: tokens are chosen
from its logits), ``float`` the float kernel. The choices are logged at start and exported on
the worker's ``/metrics`` (``kervan_quant_kernel_info``). The packed codes are a second copy of
a dense weight (the first stays for the embedding's rows); a MoE expert's packed copy is its only
one (its codes are dropped once packed: a GGUF mixture of experts is held once, not twice)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from torch import nn

from kervan.envs import quant_activations
from worker.kv.memory import in_one_arena
from worker.quant.int8_layout import code_offset, pack_int8
from worker.quant.weight import QuantizedWeight

log = logging.getLogger(__name__)
DEFAULT_KERNEL = "int8x2"  # what KERVAN_QUANT_ACTIVATIONS=auto takes for integer codes


@dataclass(frozen=True)
class KernelChoice:
    """One distinct quantized weight and the kernel its calls take."""

    out_features: int
    in_features: int
    method: str
    group: int
    kernel: str  # "float", "int8", or "int8x2" (two int8 terms; the LM head's integer kernel)
    reason: str  # "default", "forced", or why int8 does not apply

    def describe(self) -> str:
        return f"{self.out_features}x{self.in_features} {self.method or 'quantized'}: {self.kernel}, {self.reason}"


def choose_kernels(model: nn.Module) -> list[KernelChoice]:
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
            decided[key(w)] = _decide(w, is_head=key(w)[-1])
    # by the codes' identity (a tied head and its embedding pack once), in the model's order; the
    # experts apart, below
    experts = {id(q.codes) for m in model.modules() for pair in getattr(m, "expert_quants", None) or [] for q in pair}
    packed = {id(w.codes): _packed(w, decided[key(w)].kernel) for w in weights
              if decided[key(w)].kernel != "float" and id(w.codes) not in experts}
    packed = dict(zip(packed, in_one_buffer(list(packed.values()))))
    del weights  # the experts' codes are freed as each is packed, below
    for module in model.modules():
        quant = getattr(module, "quant", None)
        if isinstance(quant, QuantizedWeight):
            module.quant = packed.get(id(quant.codes), quant)
        pairs = getattr(module, "expert_quants", None)
        if pairs:
            for i, pair in enumerate(pairs):  # in place: an expert's codes go as its packed copy comes
                pairs[i] = tuple(_expert_packed(q, decided[key(q)].kernel) for q in pair)
            module.expert_quants = list(pairs)  # a new list: the layer's fused call is made again for it
    choices = list(decided.values())
    for choice in choices:
        log.info("quantized matmul %s", choice.describe())
    return choices


def _expert_packed(w: QuantizedWeight, kernel: str) -> QuantizedWeight:
    """An expert's weight in its kernel's layout, holding nothing else: its codes are read by
    nothing but the packed copy (a GGUF mixture of experts is held once, not twice)."""
    return w if kernel == "float" else without_codes(_packed(w, kernel))


def without_codes(w: QuantizedWeight) -> QuantizedWeight:
    """``w`` holding only its int8-activation layout where it has one: codes, scales and zeros
    emptied to [out_features, 0] (its shape is kept; dequantizing it fails loudly)."""
    if w.int8 is None:
        return w

    def empty(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.new_empty(t.shape[0], 0)
    return replace(w, codes=empty(w.codes), scales=empty(w.scales), zeros=empty(w.zeros))


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
    if w.int8 is not None and w.codes.numel() == 0:  # packed before, its codes dropped (``without_codes``)
        return w
    return replace(w, int8=None) if kernel == "float" else with_int8(w, terms=2 if kernel == "int8x2" else 1)


def _decide(w: QuantizedWeight, is_head: bool) -> KernelChoice:
    base = dict(out_features=w.out_features, in_features=w.in_features, method=w.method, group=w.group)
    if code_offset(w) is None:
        return KernelChoice(**base, kernel="float", reason="int8 activations do not apply to these codes")
    setting = quant_activations()
    kernel = DEFAULT_KERNEL if setting == "auto" else setting
    if is_head and kernel == "int8":  # the head's logits choose tokens: x to two int8 terms
        kernel = "int8x2"
    return KernelChoice(**base, kernel=kernel, reason="default" if setting == "auto" else "forced")
