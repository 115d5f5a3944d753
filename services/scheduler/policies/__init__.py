"""Placement policies, one file each, found by name (``base.py`` has the interface): the
KV-aware cost (``kv``, the default) and the baselines a user could pick instead, which the
placement benchmark measures it against (``round_robin``, ``random``, ``prefix_hash``,
``approx_tree``). Every module of this package is imported here, so a policy registers
itself by being a file in it."""

from __future__ import annotations

import importlib
import pkgutil
import random

from services.scheduler.placement import PlacementConfig
from services.scheduler.policies.base import POLICIES, PlacementPolicy, register

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def make_policy(config: PlacementConfig, rng: random.Random | None = None) -> PlacementPolicy:
    if config.policy not in POLICIES:
        raise ValueError(f"placement policy {config.policy!r} is not one of {', '.join(sorted(POLICIES))}")
    return POLICIES[config.policy](config, rng)


__all__ = ["POLICIES", "PlacementPolicy", "make_policy", "register"]
