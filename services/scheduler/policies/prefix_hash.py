"""Baseline: consistent hashing on the prompt's prefix, as a ring-hash load balancer
(Envoy's, or llm-d's prefix-hash scorer) does it. The hash of the first
``hash_prefix_blocks`` blocks picks a point on a ring of ``VIRTUAL_NODES`` points per
worker; the first worker clockwise takes it. Same prefix, same worker, without any
knowledge of caches or load; a worker joining or leaving moves only its share."""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

from services.scheduler.placement import Ask, Candidate, Choice
from services.scheduler.policies.base import PlacementPolicy, register

VIRTUAL_NODES = 64


def ring_pick(worker_ids: list[str], key: bytes) -> str:
    """The worker owning ``key`` on a ring of ``VIRTUAL_NODES`` points per worker."""
    ring = sorted((_point(f"{w}#{i}".encode()), w) for w in worker_ids for i in range(VIRTUAL_NODES))
    at = bisect.bisect_left(ring, (_point(key), ""))
    return ring[at % len(ring)][1]


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prefix_key(block_hashes: Sequence[bytes], hash_prefix_blocks: int) -> bytes:
    """What is hashed: the chained hash of the first blocks (the last one of them covers
    them all); a prompt under one block hashes as empty."""
    if not block_hashes:
        return b""
    return bytes(block_hashes[min(len(block_hashes), hash_prefix_blocks) - 1])


@register
class PrefixHashPolicy(PlacementPolicy):
    name = "prefix_hash"
    needs_room = False  # it knows nothing of memory

    def choose(self, pool: list[Candidate], ask: Ask) -> Choice:
        chosen = ring_pick([c.worker_id for c in pool], prefix_key(ask.block_hashes, self.config.hash_prefix_blocks))
        return Choice(next(c for c in pool if c.worker_id == chosen), {})
