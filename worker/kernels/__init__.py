"""Native CPU kernels (``*.cpp`` here), loaded once per process.

- ``paged_kv.cpp``: decode attention that reads each sequence's KV blocks in place
  (plain PyTorch must first gather them into a padded copy, which dominated a
  decode step), and the write of new K/V into their slots;
- ``fused_ops.cpp``: RMSNorm with the residual add, SiLU-and-multiply and rotary
  embedding, each one pass over a row (``worker/layers/fused.py`` calls them).

They are built for this machine's ISA level on first use (``build.py``: about
35 s with the machine's compiler, cached under ``KERVAN_CACHE_DIR/kernels``) or
ahead of time with ``kervan build-kernels``. When they cannot be built or loaded
the engine uses the PyTorch path and says so once; ``KERVAN_ATTENTION_BACKEND=native``
makes that an error instead."""

from __future__ import annotations

import functools
import logging

import torch

from kervan.envs import attention_backend, cache_dir, kernel_build_wait_s
from worker.kernels.build import KernelBuildError, ensure_built
from worker.platform import current_platform

log = logging.getLogger(__name__)
_loaded: list[str] = []  # the library this process loaded: its ops register once per process


@functools.cache
def has_native_kernels() -> bool:
    """True when ``torch.ops.kervan.*`` are usable in this process."""
    if attention_backend() == "torch":
        return False
    if _loaded:
        return True
    try:
        lib = str(ensure_built(cache_dir(), current_platform().cpu.isa, kernel_build_wait_s()))
        torch.ops.load_library(lib)
        _loaded.append(lib)
        return True
    except (KernelBuildError, OSError, RuntimeError) as exc:
        if attention_backend() == "native":
            raise
        log.warning("native CPU kernels unavailable: %s; using the PyTorch path", exc)
        return False
