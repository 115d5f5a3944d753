"""Baseline: SGLang's cache-aware router. The scheduler remembers, per worker, the prompts
it sent there (as block hashes, at most ``tree_blocks_per_worker`` each, least recently
used evicted first: an approximate radix tree, with no KV events). When loads are
imbalanced (the busiest runs more than ``balance_abs_threshold`` requests over the idlest,
and more than ``balance_rel_threshold`` times as many) the idlest worker takes the
request; otherwise the worker whose tree matches the prompt best takes it if that match
covers more than ``cache_threshold`` of the prompt, else the worker with the smallest
tree. SGLang's defaults: 0.5, 32, 1.0001."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from services.scheduler.placement import Ask, Candidate, Choice, PlacementConfig
from services.scheduler.policies.base import PlacementPolicy, register


class ApproxTrees:
    """Per worker, the block hashes of prompts sent there, least recently used first."""

    def __init__(self, tree_blocks_per_worker: int = 1 << 16):
        self.capacity = tree_blocks_per_worker
        self.trees: dict[str, OrderedDict[bytes, None]] = {}

    def matched(self, worker_id: str, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of the prompt the worker's tree holds (hashes chain: a present
        block implies its prefix was sent there)."""
        tree: OrderedDict[bytes, None] | dict[bytes, None] = self.trees.get(worker_id, {})
        n = 0
        for h in block_hashes:
            if h not in tree:
                break
            n += 1
        return n

    def size(self, worker_id: str) -> int:
        return len(self.trees.get(worker_id, ()))

    def insert(self, worker_id: str, block_hashes: Sequence[bytes]) -> None:
        tree = self.trees.setdefault(worker_id, OrderedDict())
        for h in block_hashes:
            tree[h] = None
            tree.move_to_end(h)
        while len(tree) > self.capacity:
            tree.popitem(last=False)

    def forget_except(self, live: set[str]) -> None:
        for worker_id in set(self.trees) - live:
            del self.trees[worker_id]


@register
class ApproxTreePolicy(PlacementPolicy):
    name = "approx_tree"
    needs_room = False  # SGLang's router sees no worker's memory

    def __init__(self, config: PlacementConfig, rng: random.Random | None = None, trees: ApproxTrees | None = None):
        super().__init__(config, rng)
        self.trees = trees or ApproxTrees()

    def choose(self, pool: list[Candidate], ask: Ask) -> Choice:
        cfg = self.config
        idlest = min(pool, key=lambda c: (c.num_requests, c.worker_id))
        busiest = max(c.num_requests for c in pool)
        if busiest - idlest.num_requests > cfg.balance_abs_threshold and \
                busiest > idlest.num_requests * cfg.balance_rel_threshold:
            return Choice(idlest, {}, "balance")
        best = max(pool, key=lambda c: (c.matched_blocks, -c.num_requests))
        if ask.num_prompt_blocks and best.matched_blocks / ask.num_prompt_blocks > cfg.cache_threshold:
            return Choice(best, {}, "cache")
        return Choice(min(pool, key=lambda c: (self.trees.size(c.worker_id), c.worker_id)), {}, "smallest_tree")

    def remembered_blocks(self, worker_id: str, block_hashes: Sequence[bytes]) -> int | None:
        return self.trees.matched(worker_id, block_hashes)  # what it sent where, never what workers report

    def placed(self, worker_id: str, block_hashes: Sequence[bytes], live: Iterable[str]) -> None:
        self.trees.forget_except(set(live))
        self.trees.insert(worker_id, block_hashes)
