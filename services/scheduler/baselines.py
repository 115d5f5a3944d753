"""Placement policies a user would pick instead of Kervan's KV-aware cost, kept as
baselines the placement benchmark measures against (and usable: ``--policy``).

- ``prefix_hash``: consistent hashing on the prompt's prefix, as a ring-hash load
  balancer (Envoy's, or llm-d's prefix-hash scorer) does it: the hash of the first
  ``hash_prefix_blocks`` blocks picks a point on a ring of 64 virtual nodes per
  worker; the first worker clockwise takes it. Same prefix, same worker, without any
  knowledge of caches or load; a worker joining or leaving moves only its share.
- ``approx_tree``: SGLang's cache-aware router. The scheduler remembers, per worker,
  the prompts it sent there (as block hashes, at most ``tree_blocks_per_worker`` each,
  least recently used evicted first: an approximate radix tree, with no KV events).
  When loads are imbalanced (the busiest runs more than ``balance_abs_threshold``
  requests over the idlest, and more than ``balance_rel_threshold`` times as many) the
  idlest worker takes the request; otherwise the worker whose tree matches the prompt
  best takes it if that match covers more than ``cache_threshold`` of the prompt, else
  the worker with the smallest tree. SGLang's defaults: 0.5, 32, 1.0001."""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict

VIRTUAL_NODES = 64


def ring_pick(worker_ids: list[str], key: bytes) -> str:
    """The worker owning ``key`` on a ring of ``VIRTUAL_NODES`` points per worker."""
    ring = sorted((_point(f"{w}#{i}".encode()), w) for w in worker_ids for i in range(VIRTUAL_NODES))
    at = bisect.bisect_left(ring, (_point(key), ""))
    return ring[at % len(ring)][1]


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prefix_key(block_hashes: list[bytes], hash_prefix_blocks: int) -> bytes:
    """What ``prefix_hash`` hashes: the chained hash of the first blocks (the last one of
    them covers them all); a prompt under one block hashes as empty."""
    if not block_hashes:
        return b""
    return bytes(block_hashes[min(len(block_hashes), hash_prefix_blocks) - 1])


class ApproxTrees:
    """Per worker, the block hashes of prompts sent there, least recently used first."""

    def __init__(self, tree_blocks_per_worker: int = 1 << 16):
        self.capacity = tree_blocks_per_worker
        self.trees: dict[str, OrderedDict[bytes, None]] = {}

    def matched(self, worker_id: str, block_hashes: list[bytes]) -> int:
        """Leading blocks of the prompt the worker's tree holds (hashes chain: a present
        block implies its prefix was sent there)."""
        tree = self.trees.get(worker_id, {})
        n = 0
        for h in block_hashes:
            if h not in tree:
                break
            n += 1
        return n

    def size(self, worker_id: str) -> int:
        return len(self.trees.get(worker_id, ()))

    def insert(self, worker_id: str, block_hashes: list[bytes]) -> None:
        tree = self.trees.setdefault(worker_id, OrderedDict())
        for h in block_hashes:
            tree[h] = None
            tree.move_to_end(h)
        while len(tree) > self.capacity:
            tree.popitem(last=False)

    def forget_except(self, live: set[str]) -> None:
        for worker_id in set(self.trees) - live:
            del self.trees[worker_id]
