"""A model's shape read from its directory, its ``config.json`` or a pulled catalog name:
what ``kervan plan``, the planner service and the served profile all start from."""

from __future__ import annotations

import json
from pathlib import Path

import click

from control_plane.plan.model_shape import BYTES_PER_WEIGHT, ModelShape


def model_shape(model: str) -> tuple[ModelShape, str, str]:
    """(its shape, the weight format its directory holds, its float dtype) for a model
    directory, a ``config.json``, or a pulled catalog name."""
    from control_plane.tools.pull import GGUF_WEIGHTS, PullError, pulled_weights, resolve_model
    from worker.config import ConfigError, ModelConfig

    path = Path(model).expanduser()
    if path.name != "config.json":
        try:
            path = resolve_model(model) / "config.json"
        except PullError as exc:
            raise click.UsageError(f"{exc} (or pass a model directory or its config.json)") from None
    if not path.is_file():
        raise click.UsageError(f"{model}: no config.json (a Hugging Face model directory, or its config.json)")
    raw = json.loads(path.read_text())
    try:
        shape = ModelShape.from_config(path.parent.name, ModelConfig.from_hf_dict(raw))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    held = pulled_weights(path.parent)
    weights = "gguf-q4_1" if held == GGUF_WEIGHTS else held or raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    if weights not in BYTES_PER_WEIGHT:
        weights = "bfloat16"
    return shape, weights, weights if weights in ("float32", "float16") else "bfloat16"
