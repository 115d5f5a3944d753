"""Tier 1 behind the engine's KV pool: blocks that leave the pool, kept in host memory
under their hashes, so that a prefix seen before — evicted since, or the blocks of a
preempted sequence — is copied back instead of computed again.

A fixed number of block-sized slots (``kv_host_bytes`` worth), pinned on CUDA so the
copies can run asynchronously, plain memory on the CPU. Least recently used first out:
a block put or taken moves to the back. The tier holds copies: a block promoted back
into the pool stays here too, so its next eviction costs nothing to demote.

Each slot holds one block in the handoff's layout, every layer and KV head:
``[layers, 2, kv_heads, block_size * head_dim]``; ``take`` gives a run of them as
``[layers, 2, n, kv_heads, block_size * head_dim]``, what ``KVWrite`` places."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kervan.block_hash import BlockHash
from worker.kv.slots import HashSlots


class HostTier(HashSlots):
    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False):
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        layers, kv, *rest = block_shape
        # the blocks along dim 2, as the handoff's layout has them: a run of blocks goes in and
        # out as one copy, never a copy per block; zeros, not empty: every page is touched now,
        # not by the first demotions into it
        self.data = torch.zeros((layers, kv, num_blocks, *rest), dtype=dtype, pin_memory=pin)
        super().__init__(num_blocks)
        self.num_stored = 0  # blocks demoted into the tier
        self.num_promoted = 0  # blocks copied back into the pool

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    def put(self, hashes: Sequence[BlockHash], data: torch.Tensor,
            spill: Callable[[list[BlockHash], torch.Tensor], None] | None = None) -> list[BlockHash]:
        """Store blocks (``data``: ``[layers, 2, len(hashes), ...]``), pushing out the least
        recently used when full; returns the hashes pushed out. A hash already held is only
        refreshed (same content). ``spill`` gets the pushed-out blocks and a copy of their KV
        before their slots are overwritten (the next tier down)."""
        overflow: list[BlockHash] = []
        if len(hashes) > self.num_blocks:  # more than it holds: the last ones stay, the first go on
            extra = len(hashes) - self.num_blocks
            keep = [k for k, h in enumerate(hashes[:extra]) if h not in self.slots]
            overflow = [hashes[k] for k in keep]
            if overflow and spill is not None:
                spill(overflow, data[:, :, keep])
            hashes, data = hashes[extra:], data[:, :, extra:]
        dropped, taken, sources = [], [], []
        for k, h in enumerate(hashes):
            if h in self.slots:
                self.slots.move_to_end(h)
                continue
            slot, pushed = self.claim(h)
            if pushed is not None:
                dropped.append(pushed)
            taken.append(slot)
            sources.append(k)
        gone = [(h, slot) for h, slot in zip(dropped, taken[len(taken) - len(dropped):]) if h not in self.slots]
        if gone and spill is not None:  # once the free slots ran out, each new block took a dropped one's slot
            spill([h for h, _ in gone], self.data.index_select(2, torch.tensor([s for _, s in gone])))
        if taken:
            if len(sources) < len(hashes):
                data = data.index_select(2, torch.tensor(sources, dtype=torch.long))
            if _consecutive(taken):  # one plain copy (a fresh tier hands out runs)
                self.data.narrow(2, taken[0], len(taken)).copy_(data)
            else:
                self.data.index_copy_(2, torch.tensor(taken, dtype=torch.long), data)
            self.num_stored += len(taken)
        return [h for h in overflow if h not in self.slots] + [h for h, _ in gone]

    def take(self, hashes: Sequence[BlockHash], copy: bool = True) -> torch.Tensor:
        """Held blocks, ``[layers, 2, len(hashes), ...]``; each becomes the most recently
        used. Without ``copy``, blocks in consecutive slots come as a view of the tier's
        memory, valid until the next ``put`` (the engine's step reads it first)."""
        slots = []
        for h in hashes:
            slots.append(self.slots[h])
            self.slots.move_to_end(h)
        self.num_promoted += len(slots)
        if _consecutive(slots):
            run = self.data.narrow(2, slots[0], len(slots))
            return run.clone() if copy else run
        return self.data.index_select(2, torch.tensor(slots, dtype=torch.long))



def _consecutive(slots: list[int]) -> bool:
    return all(b - a == 1 for a, b in zip(slots, slots[1:]))
