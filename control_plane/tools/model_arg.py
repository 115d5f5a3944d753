"""``--model`` as the commands and the planner service take it: the embedded default model
(written on first use; also by the name "embedded"), a model from the catalog by name, or a
directory. Apart from the CLI, so that a service (the planner) reads it without importing the
CLI. A command a person runs pulls a catalog model on first use (``pull_missing``), as
``ollama run`` does; a service never does."""

from __future__ import annotations

from pathlib import Path

import click

from kervan.progress import Phases


def model_path(value: str | None, pull_missing: bool = False, phases: Phases | None = None) -> Path:
    """``--model`` -> a directory; a name that is neither is a ``click.BadParameter``, and a
    failed pull a ``click.ClickException`` that says why and what to do offline."""
    from control_plane.tools.pull import NotPulled, PullError, pull, resolve_model
    from worker.default_model import ensure_default_model

    if value is None:
        return ensure_default_model()
    try:
        return resolve_model(value)
    except NotPulled as exc:
        if not pull_missing:
            raise click.BadParameter(str(exc), param_hint="--model") from None
    except PullError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from None
    click.echo(f"{value} is not in the cache yet: pulling it once (as `kervan pull {value}` does)", err=True)
    try:
        return pull(value, say=lambda line: click.echo(line, err=True), phases=phases)
    except PullError as exc:
        raise click.ClickException(str(exc)) from None
