"""Quantization methods: how a float weight becomes a ``QuantizedWeight``.

One interface, one file per method, one registry: each method's file ``register``s its
variants, and the registry imports every module of ``worker.quant`` before it is first read,
so ``--quantization NAME`` offers a new format as soon as its file exists. Each method
quantizes one matrix ``[out_features, in_features]`` by rows and by groups along the
input features, so a rank that quantizes its own slice of a weight gets exactly the
rows (or groups) the whole weight's quantization would give it."""

from __future__ import annotations

import functools
import importlib
import pkgutil
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


_METHODS: dict[str, QuantMethod] = {}


def register(*methods: QuantMethod) -> None:
    """Offer ``methods`` under their names (a method file calls it when imported)."""
    for method in methods:
        if method.name in _METHODS and _METHODS[method.name] is not method:
            raise ValueError(f"two quantization methods are named {method.name!r}")
        _METHODS[method.name] = method


def get_method(name: str) -> QuantMethod:
    methods = _registry()
    if name not in methods:
        raise ValueError(f"unknown quantization {name!r}; known: {', '.join(method_names())}")
    return methods[name]


def method_names() -> list[str]:
    return sorted(_registry())


@functools.cache
def _registry() -> dict[str, QuantMethod]:
    import worker.quant as package

    for module in pkgutil.iter_modules(package.__path__):  # each method's file registers its variants
        importlib.import_module(f"{package.__name__}.{module.name}")
    return _METHODS
