"""Service configuration: flags first, then the environment, then defaults.

Every option ``--some-option`` of service ``NAME`` can also be set with the
environment variable ``KERVAN_<NAME>_<SOME_OPTION>`` (for example
``KERVAN_WORKER_NUM_KV_BLOCKS=512`` or ``KERVAN_ROUTER_SCHEDULER=127.0.0.1:9000``),
which suits containers and Kubernetes manifests; a flag given on the command line wins."""

from __future__ import annotations

import argparse
import os


def env_name(service: str, dest: str) -> str:
    return f"KERVAN_{service.upper().replace('-', '_')}_{dest.upper()}"


def parse_args(parser: argparse.ArgumentParser, service: str, argv: list[str] | None = None) -> argparse.Namespace:
    for action in parser._actions:
        if action.dest == "help" or action.option_strings == []:
            continue
        value = os.environ.get(env_name(service, action.dest))
        if value is None:
            continue
        try:
            action.default = action.type(value) if action.type else value
        except ValueError:
            parser.error(f"{env_name(service, action.dest)}={value!r} is not a valid {action.dest}")
        action.required = False
    return parser.parse_args(argv)
