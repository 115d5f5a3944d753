"""Where the embedded default model lives, for the processes that only read its
``config.json`` and ``tokenizer.json`` (the router): its weights are written by
``worker.default_model`` (torch), which these processes run as a child, never import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kervan.envs import cache_dir

NAME = "kervan-tiny-llama-v1"


def default_model_dir() -> Path:
    return cache_dir() / NAME


def is_written(target: Path) -> bool:
    """Whether the model directory is complete (it is written elsewhere and renamed into place)."""
    return (target / "model.safetensors").is_file()


def default_model_written() -> Path:
    """The default model's directory, written first (by a child process, which loads
    torch so that this one does not) when it is not there yet."""
    target = default_model_dir()
    if not is_written(target):
        subprocess.run([sys.executable, "-m", "worker.default_model"], check=True)
    return target
