# mypy: disable-error-code="arg-type,assignment,index,misc,operator,union-attr"
"""Quantizing a loaded model's weights in place (``--quantization NAME``).

After the loader has filled this rank's slices in the model's dtype, every dense
linear (q/k/v, o, gate/up, down) and every local expert's two matmuls take the
method's codes; the LM head, and the embedding where tied to it, take int8 per channel
(llama.cpp keeps its ``output``/``token_embd`` at 8 bits for the same reason: the
head reads a fifth of a small model's weights per step, and int8 costs it no
measurable quality). Layers whose input width the method's block does not divide keep
their float weights, with one warning. Routers, norms and biases stay in float."""

from __future__ import annotations

import logging

from torch import nn

from worker.quant.method import get_method
from worker.quant.weight import QuantizedWeight

log = logging.getLogger(__name__)
HEAD_METHOD = "int8"


def quantize_model(model: nn.Module, name: str) -> int:
    """Replace weights by their codes; returns how many matrices were quantized."""
    method, count, kept = get_method(name), 0, []
    for module in model.dense_linears():
        if module is model.lm_head:
            continue
        if module.quant is None and module.weight is not None:
            if module.weight.shape[1] % method.block:
                kept.append(tuple(module.weight.shape))
                continue
            set_quantized(module, method.quantize(module.weight.data))
            count += 1
    for moe in model.moes:
        count += moe.quantize(method)
    count += _quantize_head(model)
    if kept:
        log.warning("%s: %d linear(s) keep their float weights: in_features not a multiple of %d (%s)",
                    name, len(kept), method.block, sorted(set(kept)))
    return count


def _quantize_head(model: nn.Module) -> int:
    head, embed = model.lm_head, model.embed
    tied = head is not None and embed is not None and head.weight is embed.weight
    count = 0
    for module in ([head] if head is not None else []) + ([embed] if embed is not None and not tied else []):
        if module.quant is None and module.weight is not None and module.weight.shape[1] % 16 == 0:
            set_quantized(module, get_method(HEAD_METHOD).quantize(module.weight.data))
            count += 1
    if tied and head.quant is not None:
        set_quantized(embed, head.quant)
    return count


def set_quantized(module: nn.Module, quant: QuantizedWeight) -> None:
    module.quant = quant
    module.register_parameter("weight", None)


def quantized_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the weights by kind: ``quantized`` (codes, scales, zeros, and the int8
    kernel's packed copy where a weight has one) and ``float`` (every parameter left, norms
    and routers included, and the packed layouts of the weights they replaced); a tied matrix
    counts once."""
    seen: set[int] = set()
    quantized = 0
    for module in model.modules():
        for q in _quantized_of(module):
            if id(q.codes) not in seen:
                seen.add(id(q.codes))
                quantized += q.nbytes + (q.int8.nbytes if q.int8 is not None else 0)
    floats = sum(p.nbytes for p in {id(p): p for p in model.parameters()}.values())
    floats += sum(m.packed.data.nbytes for m in model.modules()
                  if getattr(m, "packed", None) is not None and m.weight is None)
    floats += sum(p.data.nbytes for m in model.modules() for pair in getattr(m, "expert_packs", None) or []
                  for p in pair)
    return {"quantized": quantized, "float": floats, "total": quantized + floats}


def quantized_weights(model: nn.Module) -> list[QuantizedWeight]:
    """Every quantized matrix of the model once (a tied head and its embedding are one)."""
    found: dict[int, QuantizedWeight] = {}
    for module in model.modules():
        for q in _quantized_of(module):
            found.setdefault(id(q.codes), q)
    return list(found.values())


def _quantized_of(module: nn.Module) -> list[QuantizedWeight]:
    found = getattr(module, "quant", None)
    experts = getattr(module, "expert_quants", None) or []
    return ([found] if isinstance(found, QuantizedWeight) else []) + [q for pair in experts for q in pair]
