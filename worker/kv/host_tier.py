"""Tier 1 behind the engine's KV pool: blocks that leave the pool, kept in host memory
under their hashes, so that a prefix seen before — evicted since, or the blocks of a
preempted sequence — is copied back instead of computed again.

A fixed number of block-sized slots (``kv_host_bytes`` worth), pinned on CUDA so the
copies can run asynchronously, plain memory on the CPU. Least recently used first out:
a block put or taken moves to the back. The tier holds copies: a block promoted back
into the pool stays here too, so its next eviction costs nothing to demote.

Each slot holds one block in the handoff's layout, every layer and KV head:
``[layers, 2, kv_heads, block_size * head_dim]``; ``take_runs`` gives runs of them as
``[layers, 2, n, kv_heads, block_size * head_dim]`` views, what ``KVWrite`` places.

Blocks arrive in eviction order, a request's tail first (``KVCacheManager.free``), and
that is their LRU order here too: a prefix loses its tail before its head. Their slots
are handed out the other way round, a prefix in ascending slots, so that a prefix
promoted later is one run of slots, copied into the pool from a view of the tier:

    evicted     A3 A2 A1 A0 B1 B0        (two requests, each tail first)
    LRU order   A3 A2 A1 A0 B1 B0        (A3 pushed out first)
    slots       5  4  3  2  1  0         B0 B1 | A0 A1 A2 A3 ascending

Within one ``store`` the claimed slots are sorted and given out in reverse; across calls
(a long decode's growth takes one cached block a step) each claim takes the slot below the
last: free slots are handed out from the top down, and once the tier is full the least
recently used blocks, which went in tail first into descending slots, give theirs up in
the same order. So a prefix demoted block by block is still one run (unless other
requests' blocks are demoted between its own)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from kervan.block_hash import BlockHash
from worker.kv.memory import zeros_on_huge_pages
from worker.kv.slots import HashSlots, consecutive_runs

# fill(positions, out): write the blocks at ``positions`` of a put's hashes into ``out``,
# ``[layers, 2, len(positions), ...]`` (a view of the tier's slots)
BlockFill = Callable[[list[int], torch.Tensor], None]
Spill = Callable[[list[BlockHash], torch.Tensor], None]


class HostTier(HashSlots):
    highest_first = True  # tail-first demotions, one call after another, land in descending slots

    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False):
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        layers, kv, *rest = block_shape
        # the blocks along dim 2, as the handoff's layout has them: a run of blocks goes in and
        # out as one copy, never a copy per block; every page is touched now, not by the first
        # demotions into it
        shape = (layers, kv, num_blocks, *rest)
        self.data = torch.zeros(shape, dtype=dtype, pin_memory=True) if pin else zeros_on_huge_pages(shape, dtype)
        super().__init__(num_blocks)
        self.num_stored = 0  # blocks demoted into the tier
        self.num_promoted = 0  # blocks copied back into the pool

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    def put(self, hashes: Sequence[BlockHash], data: torch.Tensor, spill: Spill | None = None) -> list[BlockHash]:
        """``store`` from a tensor, ``[layers, 2, len(hashes), ...]``."""
        def fill(positions: list[int], out: torch.Tensor) -> None:
            torch.index_select(data, 2, torch.tensor(positions, dtype=torch.long), out=out)
        return self.store(hashes, fill, spill)

    def store(self, hashes: Sequence[BlockHash], fill: BlockFill, spill: Spill | None = None,
              lent: Collection[BlockHash] = ()) -> list[BlockHash]:
        """Store blocks, given in eviction order, pushing out the least recently used when
        full; returns the hashes pushed out. ``fill`` writes the new blocks straight into
        their slots (one copy from the pool). A hash already held is only refreshed (same
        content). ``spill`` gets the pushed-out blocks and a copy of their KV before their
        slots are overwritten (the next tier down). ``lent``: held blocks whose slots a
        copy still reads (``take_runs``' views, this step): never pushed out, so a batch
        larger than the rest of the tier keeps its last blocks and spills the first."""
        refreshed = [h for h in hashes if h in self.slots]
        for h in refreshed:
            self.slots.move_to_end(h)
        new = [k for k, h in enumerate(hashes) if h not in self.slots]
        # the slots that may be claimed: the free ones, then the held ones before the refreshed and
        # the lent, which now sit at the back of the LRU order
        room = self.num_blocks - len(set(refreshed).union(lent))
        overflow, new = new[:max(0, len(new) - room)], new[max(0, len(new) - room):]
        if overflow and spill is not None:
            spill([hashes[k] for k in overflow], self._filled(overflow, fill))
        claimed, gone = [], []
        for k in new:
            slot, pushed = self.claim(hashes[k])
            claimed.append(slot)
            if pushed is not None:
                gone.append((pushed, slot))
        if gone and spill is not None:  # read before any slot is written
            spill([h for h, _ in gone], self.data.index_select(2, torch.tensor([s for _, s in gone])))
        # a prefix in ascending slots: the new blocks in prefix order (eviction order reversed)
        slots = sorted(claimed)
        for k, slot in zip(reversed(new), slots):
            self.slots[hashes[k]] = slot
        order = list(reversed(new))
        for start, n in consecutive_runs(slots):
            fill(order[start:start + n], self.data.narrow(2, slots[start], n))
        self.num_stored += len(new)
        return [hashes[k] for k in overflow] + [h for h, _ in gone]

    def _filled(self, positions: list[int], fill: BlockFill) -> torch.Tensor:
        out = self.data.new_empty((*self.data.shape[:2], len(positions), *self.data.shape[3:]))
        fill(positions, out)
        return out

    def take(self, hashes: Sequence[BlockHash]) -> torch.Tensor:
        """A copy of held blocks, ``[layers, 2, len(hashes), ...]``; each becomes the most
        recently used."""
        return self.data.index_select(2, torch.tensor(self._touch(hashes), dtype=torch.long))

    def take_runs(self, hashes: Sequence[BlockHash]) -> list[torch.Tensor]:
        """Held blocks as views of the tier's memory, one per run of consecutive slots, in
        the order of ``hashes`` (each ``[layers, 2, run, ...]``); each becomes the most
        recently used. Valid until the next ``store`` that does not count them ``lent``."""
        slots = self._touch(hashes)
        return [self.data.narrow(2, slots[start], n) for start, n in consecutive_runs(slots)]

    def view(self, hashes: Sequence[BlockHash]) -> torch.Tensor:
        """Held blocks, ``[layers, 2, len(hashes), ...]``, leaving their LRU order as it is."""
        return self.data.index_select(2, torch.tensor([self.slots[h] for h in hashes], dtype=torch.long))

    def _touch(self, hashes: Sequence[BlockHash]) -> list[int]:
        slots = []
        for h in hashes:
            slots.append(self.slots[h])
            self.slots.move_to_end(h)
        self.num_promoted += len(slots)
        return slots

