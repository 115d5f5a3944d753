"""A Kervan cache of a test's own, as a fresh machine has it."""

from __future__ import annotations

import os
from pathlib import Path

from kervan.envs import cache_dir


def fresh_cache(tmp_path: Path) -> dict:
    """An environment whose Kervan cache is empty but for the native kernels (their own
    tests build them from nothing: tests/worker/test_kernel_build.py)."""
    from worker.kernels import has_native_kernels
    has_native_kernels()  # builds them here if they are missing
    (cache_dir() / "kernels").mkdir(parents=True, exist_ok=True)
    (tmp_path / "kernels").symlink_to(cache_dir() / "kernels", target_is_directory=True)
    return {**os.environ, "KERVAN_CACHE_DIR": str(tmp_path)}
