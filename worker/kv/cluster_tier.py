"""The cluster KV tier: a prompt's prefix held by another worker is moved, not computed again.

Source side (``read_held``): the KV of the leading blocks of a list of hashes that this engine
holds, from its pool's cache, its host tier, then its disk tier (a tail read on the disk tier's
thread), in the handoff's layout ``[layers, 2, n, kv_heads, block_size * head_dim]``; nothing is
computed and nothing changes tier. Receiving side (``worker.sequence.FetchedKV``): what the
worker computing the prompt got, from which of the prompt's blocks on; ``KVCacheManager.prefix``
writes it into the blocks after the pool's own hit, where the two meet (a fetch that no longer
lines up, the pool's hit having shrunk or grown past it meanwhile, is dropped and the blocks computed)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kervan.block_hash import BlockHash
from worker.kv.block_pool import BlockPool
from worker.kv.disk_tier import DiskTier
from worker.kv.host_tier import HostTier


@dataclass(frozen=True)
class HeldRead:
    """What ``read_held`` found: the pool's and host tier's part now, the disk's later."""

    data: torch.Tensor  # the leading blocks held in the pool or the host tier (perhaps none)
    # the disk tier's read of the blocks after them: (hashes, raw), see DiskTier.fetch
    disk: Future[tuple[list[BlockHash], list[bytearray]]] | None


def read_held(hashes: Sequence[BlockHash], pool: BlockPool, host: HostTier | None, disk: DiskTier | None,
              read_blocks: Callable[[list[int]], torch.Tensor]) -> HeldRead:
    """The leading run of ``hashes`` this engine holds (on its engine thread: the pool's blocks
    are read between steps). Runs of pool blocks are read in one copy each, runs of host blocks
    as one view each; the first block held in neither ends the run, and from it on the disk
    tier's leading blocks are read on its thread. ``read_blocks([])``: zero blocks."""
    sources: list[tuple[str, BlockHash | int]] = []  # ("pool", block id) or ("host", hash)
    for h in hashes:
        block = pool.get_cached_block(h)
        if block is not None:
            sources.append(("pool", block.block_id))
        elif host is not None and h in host:
            sources.append(("host", h))
        else:
            break
    parts = []
    for kind, run in itertools.groupby(sources, key=lambda s: s[0]):
        keys = [k for _, k in run]
        if kind == "pool":
            parts.append(read_blocks([k for k in keys if isinstance(k, int)]))
        else:
            assert host is not None
            parts.append(host.view([k for k in keys if isinstance(k, bytes)]))
    rest = list(hashes[len(sources):])
    num_disk = disk.leading(rest) if disk is not None and rest else 0
    future = disk.fetch(rest[:num_disk]) if disk is not None and num_disk else None
    return HeldRead(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0] if parts else read_blocks([]), future)
