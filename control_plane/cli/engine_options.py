"""The engine's options as click options, made from ``EngineArgs``'s fields
(``kervan/engine_args.py``): ``kervan up`` gives them to every worker it starts, ``kervan
complete`` to its in-process engine. Nothing here names an option."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import click

from kervan.engine_args import EngineArgs, EngineArgsError, options


def engine_options(cls: type[EngineArgs] = EngineArgs, *, exclude: tuple[str, ...] = ()) -> Callable[[Any], Any]:
    """A decorator adding ``cls``'s fields (but ``exclude``) as options; the command reads
    them back with ``engine_args``."""
    def decorate(fn: Any) -> Any:
        for o in reversed(options(cls)):
            if o.name in exclude:
                continue
            if o.kind is bool:
                names = [f"{o.flags[0]}/--no-{o.flags[0].removeprefix('--')}", *o.flags[1:]]
                fn = click.option(*names, o.name, default=o.default, help=o.help, show_default=True)(fn)
                continue
            kind: Any = click.Choice(o.choices, case_sensitive=False) if o.choices else o.kind
            if o.existing_dir:
                kind = click.Path(exists=True, file_okay=False)
            fn = click.option(*o.flags, o.name, type=kind, default=o.default, help=o.help, metavar=o.metavar,
                              show_default=o.default is not None)(fn)
        return fn
    return decorate


def engine_args(opts: dict[str, Any], cls: type[EngineArgs] = EngineArgs, **fixed: Any) -> EngineArgs:
    """The command's engine options out of its keyword arguments (taken out of ``opts``), with
    ``fixed`` over them; a value the engine refuses is a usage error."""
    values = {o.name: opts.pop(o.name) for o in options(cls) if o.name in opts}
    try:
        return cls(**{**values, **fixed})
    except EngineArgsError as exc:
        raise click.UsageError(as_flags(str(exc), cls)) from None


def as_flags(message: str, cls: type[EngineArgs] = EngineArgs) -> str:
    """``message`` with each field it names written as its flag (``kv_disk_dir`` -> ``--kv-disk-dir``)."""
    names = sorted(options(cls), key=lambda o: -len(o.name))
    return re.sub(r"\b(" + "|".join(o.name for o in names) + r")\b",
                  lambda m: next(o.flags[0] for o in names if o.name == m[1]), message)
