"""Service configuration: flags first, then the environment, then defaults.

Every option ``--some-option`` of service ``NAME`` can also be set with the
environment variable ``KERVAN_<NAME>_<SOME_OPTION>`` (for example
``KERVAN_WORKER_NUM_KV_BLOCKS=512`` or ``KERVAN_ROUTER_SCHEDULER=127.0.0.1:9000``),
which suits containers and Kubernetes manifests; a flag given on the command line wins."""

from __future__ import annotations

import argparse
import os

from services.common.metrics import add_metrics_argument
from services.common.security import add_security_arguments


def env_name(service: str, dest: str) -> str:
    return f"KERVAN_{service.upper().replace('-', '_')}_{dest.upper()}"


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_bool(name: str, value: str) -> bool:
    """An environment boolean: 1/true/yes/on or 0/false/no/off (any case); anything else is
    refused, naming the variable (a bare non-empty string once meant True, ``false`` too)."""
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{name}={value!r}: expected one of {'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}")


def parse_args(parser: argparse.ArgumentParser, service: str, argv: list[str] | None = None) -> argparse.Namespace:
    for action in parser._actions:
        if action.dest == "help" or action.option_strings == []:
            continue
        name = env_name(service, action.dest)
        value = os.environ.get(name)
        if value is None:
            continue
        try:
            if action.nargs == 0:  # a switch: the variable is its dest's value (``..._SHORTLIST=false``)
                action.default = parse_bool(name, value)
            else:
                action.default = action.type(value) if callable(action.type) else value
        except ValueError as exc:
            parser.error(str(exc) if action.nargs == 0 else f"{name}={value!r} is not a valid {action.dest}")
        action.required = False
    return parser.parse_args(argv)


def service_parser(module: str, doc: str | None, *, listens: bool = True) -> argparse.ArgumentParser:
    """The parser of ``python -m MODULE`` (its description the docstring's first paragraph)
    with the flags every service takes first: ``--host`` and, for a gRPC server, ``--port``."""
    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=(doc or "").split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1",
                    help="the address to listen on (127.0.0.1 unless told otherwise)" if listens
                    else "where --metrics-port listens")
    if listens:
        ap.add_argument("--port", type=int, default=0, help="0 picks a free port (printed at start)")
    return ap


def parse_service_args(parser: argparse.ArgumentParser, service: str,
                       argv: list[str] | None = None) -> argparse.Namespace:
    """``parse_args`` after adding the flags every service takes last: ``--metrics-port``
    and the transport security group."""
    add_metrics_argument(parser)
    add_security_arguments(parser)
    return parse_args(parser, service, argv)
