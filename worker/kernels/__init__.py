"""Native kernels, compiled on first use with ``torch.utils.cpp_extension``.

Two CPU kernels for the paged KV cache live here (``paged_kv.cpp``): decode
attention, which reads each sequence's blocks in place where plain PyTorch must
first gather them into a padded copy (that copy dominated a decode step), and
the write of new K/V into their slots, a scatter that indexing does slowly.
It is built once per machine into ``KERVAN_CACHE_DIR/kernels`` (about 30 s, with
the machine's compiler) and loaded from there afterwards. When it cannot be built
the engine falls back to the PyTorch path and says so once."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from worker.envs import attention_backend, cache_dir

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("paged_kv.cpp")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


@functools.cache
def has_native_kv_kernels() -> bool:
    """True when ``torch.ops.kervan.paged_decode`` and ``write_kv`` are usable here."""
    if attention_backend() == "torch":
        return False
    try:
        _put_ninja_on_path()
        from torch.utils.cpp_extension import load
        build = cache_dir() / "kernels" / f"torch-{torch.__version__}"
        build.mkdir(parents=True, exist_ok=True)
        load(name="kervan_paged_kv", sources=[str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
             build_directory=str(build), is_python_module=False)
        return True
    except Exception as exc:  # no compiler, no ninja, unsupported platform
        if attention_backend() == "native":
            raise
        log.warning("native KV kernels unavailable (%s); using the PyTorch path", exc)
        return False


def _put_ninja_on_path() -> None:
    """The build runs ``ninja``; the PyPI package ships one that may not be on PATH."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
