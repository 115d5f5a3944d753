"""Kervan's worker engine: paged-KV, continuous-batching inference for Llama-family
and mixture-of-experts models. No gRPC in here; ``services`` wraps it.

The public names are imported lazily so that torch-free modules of this package
(``worker.kv.block_hash``, which the router and kv-registry import) stay torch-free."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "worker.engine.engine",
    "SamplingParams": "worker.engine.sampling_params",
    "InvalidRequest": "worker.engine.sampling_params",
    "RequestLimits": "worker.engine.sampling_params",
    "RequestOutput": "worker.engine.outputs",
    "CompletionOutput": "worker.engine.outputs",
    "EngineStats": "worker.engine.outputs",
    "ImportedKV": "worker.engine.engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'worker' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
