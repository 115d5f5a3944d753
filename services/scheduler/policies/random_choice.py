"""Baseline: a uniform draw among the workers with room (``--seed`` makes it repeatable)."""

from __future__ import annotations

from services.scheduler.placement import Ask, Candidate, Choice
from services.scheduler.policies.base import PlacementPolicy, register


@register
class RandomPolicy(PlacementPolicy):
    name = "random"

    def choose(self, pool: list[Candidate], ask: Ask) -> Choice:
        return Choice(self.rng.choice(pool), self.costs(pool, ask))
