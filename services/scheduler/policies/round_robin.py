"""Baseline: each placement goes to the next worker by id, whatever it caches or runs."""

from __future__ import annotations

from services.scheduler.placement import Ask, Candidate, Choice
from services.scheduler.policies.base import PlacementPolicy, register


@register
class RoundRobinPolicy(PlacementPolicy):
    name = "round_robin"

    def choose(self, pool: list[Candidate], ask: Ask) -> Choice:
        return Choice(sorted(pool, key=lambda c: c.worker_id)[ask.turn % len(pool)], self.costs(pool, ask))
