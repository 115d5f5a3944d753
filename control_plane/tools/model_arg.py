"""``--model`` as the commands and the planner service take it: the embedded default model
(written on first use), a model pulled from the catalog by name, or a directory. Apart from
the CLI, so that a service (the planner) reads it without importing the CLI."""

from __future__ import annotations

from pathlib import Path

import click


def model_path(value: str | None) -> Path:
    """``--model`` -> a directory; a name that is neither is a ``click.BadParameter``."""
    from control_plane.tools.pull import PullError, resolve_model
    from worker.default_model import ensure_default_model

    if value is None:
        return ensure_default_model()
    try:
        return resolve_model(value)
    except PullError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from None
