"""Quantization methods: how a float weight becomes a ``QuantizedWeight``.

One interface, one file per method, one registry (``METHODS``): ``--quantization NAME``
looks a method up here, so a new format is a new file and a line below. Each method
quantizes one matrix ``[out_features, in_features]`` by rows and by groups along the
input features, so a rank that quantizes its own slice of a weight gets exactly the
rows (or groups) the whole weight's quantization would give it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.quant.weight import QuantizedWeight


@dataclass(frozen=True)
class QuantMethod:
    name: str
    description: str
    quantize: Callable[[torch.Tensor], QuantizedWeight]  # float [out, in] -> its codes
    block: int  # in_features (and a row-parallel shard) must be a multiple of this


def get_method(name: str) -> QuantMethod:
    methods = _registry()
    if name not in methods:
        raise ValueError(f"unknown quantization {name!r}; known: {', '.join(method_names())}")
    return methods[name]


def method_names() -> list[str]:
    return sorted(_registry())


@functools.cache
def _registry() -> dict[str, QuantMethod]:
    from worker.quant import fp8, int4, int8, nvfp4  # each method's file lists its variants

    return {m.name: m for m in (*int8.METHODS, *int4.METHODS, *fp8.METHODS, *nvfp4.METHODS)}
