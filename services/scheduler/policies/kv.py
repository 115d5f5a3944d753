"""Kervan's KV-aware placement: the lowest cost wins (``placement.cost``: uncached prompt
blocks as work and memory, the worker's held blocks, evictions), or a softmax draw over
``-cost / temperature``. With ``new_prefix="content"`` a prompt no worker caches goes to the
worker holding the least KV content, recent placements included (SGLang's smallest tree)."""

from __future__ import annotations

import math

from services.scheduler.placement import Ask, Candidate, Choice
from services.scheduler.policies.base import PlacementPolicy, register


def held_blocks(c: Candidate) -> int:
    """What the worker holds or will: blocks in use, cached ones, prompts sent lately."""
    return c.active_blocks + c.evictable_blocks + c.sent_blocks


@register
class KvPolicy(PlacementPolicy):
    name = "kv"

    @property
    def prunable(self) -> bool:
        return self.config.temperature <= 0 and self.config.new_prefix == "cost"

    def choose(self, pool: list[Candidate], ask: Ask) -> Choice:
        scores = self.costs(pool, ask)
        cfg = self.config
        if cfg.temperature <= 0:
            if cfg.new_prefix == "content" and not any(c.matched_blocks for c in pool):
                return Choice(min(pool, key=lambda c: (held_blocks(c), c.worker_id)), scores)
            # a tie goes to the less loaded, then the first by id: the shortlist's walk order
            return Choice(min(pool, key=lambda c: (scores[c.worker_id], c.active_blocks, c.worker_id)), scores)
        best = min(scores.values())
        weights = [math.exp(-(scores[c.worker_id] - best) / cfg.temperature) for c in pool]
        return Choice(self.rng.choices(pool, weights)[0], scores)
