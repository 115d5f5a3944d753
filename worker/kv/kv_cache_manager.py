"""Per-sequence block tables on top of the ``BlockPool``.

A sequence's table covers its tokens in order; block ``i`` holds tokens
``[i * block_size, (i + 1) * block_size)``:

    tokens    |0 ......... 15|16 ........ 31|32 .. 37        |
    blocks    |   block 7    |   block 2    |  block 9 (partial)
    state      hashed (cached) hashed         written up to 37, no hash yet

Only full blocks get a hash, so only a partial last block is ever written again;
when that block is shared (a forked ``n > 1`` sample), the writer first copies it
to a private block (copy-on-write; the copy is queued for the runner).

``allocate_slots`` returns None when the pool cannot cover the seq: the
caller preempts or waits, nothing is half-allocated."""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from typing import NamedTuple

import torch

from kervan.block_hash import BlockHash
from kervan.kv_events import MEDIUM_DISK, MEDIUM_HOST, KVEvent
from worker.engine.sequence import Sequence
from worker.kv.block_pool import BlockPool, KVBlock
from worker.kv.disk_tier import DiskTier
from worker.kv.host_tier import HostTier


class BlockCopy(NamedTuple):
    src: int
    dst: int


class ComputedBlocks(NamedTuple):
    blocks: list[KVBlock]
    num_tokens: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, host: HostTier | None = None,
                 disk: DiskTier | None = None, write_through: bool = False, min_uses: int = 1):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size, enable_caching)
        self.host = host if enable_caching else None
        # tier 2 behind the host tier: blocks the host tier pushes out are written there
        # (write-back), or every block demoted is written there at once too (write-through)
        self.disk = disk if self.host is not None else None
        self.write_through = write_through
        # the reuse gate: a block leaves the pool for the tiers only once this many requests used
        # it (1: every block), so a scan of one-off prompts cannot flush the tiers' hot set; a
        # preempted sequence's blocks always pass (it resumes). Uses are counted per hash, for
        # the most recent hashes only (a bounded map, least recently used out).
        self.min_uses = min_uses
        self.uses: OrderedDict[BlockHash, int] = OrderedDict()
        self.max_tracked = 4 * (num_blocks + (host.num_blocks if host is not None else 0)
                                + (disk.num_blocks if disk is not None else 0))
        self.fetches: dict[str, Future] = {}  # sequence id -> its prefix's blocks being read from disk
        # sequence id -> the blocks read from disk for it: their hashes, their KV [layers, 2, n, ...]
        self.staged: dict[str, tuple[list[BlockHash], torch.Tensor]] = {}
        if self.disk is not None and len(self.disk):  # found again at start: the registry hears of them first
            self.pool.announce_tier(list(self.disk.slots), [], MEDIUM_DISK)
        self.pool.track_evictions = self.host is not None
        self.tables: dict[str, list[KVBlock]] = {}
        self.num_hashed: dict[str, int] = {}  # leading blocks of a sequence already in the cache map
        self._copies: list[BlockCopy] = []

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(seq_id, ())]

    def get_computed_blocks(self, seq: Sequence) -> ComputedBlocks:
        """The longest cached prefix of full blocks; at least one token is always left
        to compute, since the last prompt token's logits are needed."""
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = []
        for h in seq.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return ComputedBlocks(hits, len(hits) * self.block_size)

    def host_prefix(self, seq: Sequence, num_hit_blocks: int) -> list[BlockHash]:
        """The hashes of the blocks after a pool hit that the tiers behind the pool have
        ready to copy back (leading ones, leaving the last prompt token to compute): held by
        the host tier, or read from disk for this sequence (``awaiting_disk``)."""
        if self.host is None:
            return []
        staged = self.staged.get(seq.seq_id, ((), None))[0]
        n = 0
        for h in self._wanted(seq, num_hit_blocks):
            if h not in staged and h not in self.host:
                break
            n += 1
        return seq.block_hashes[num_hit_blocks:num_hit_blocks + n]

    def take_prefix(self, seq: Sequence, hashes: list[BlockHash]):
        """The KV of ``host_prefix``'s blocks, ``[layers, 2, len(hashes), ...]``: what was
        read from disk for the sequence, the rest from the host tier."""
        staged_hashes, staged_kv = self.staged.pop(seq.seq_id, ([], None))
        at = {h: k for k, h in enumerate(staged_hashes)}
        from_host = [h for h in hashes if h not in at]
        host = self.host.take(from_host) if from_host else None
        if not at:
            return host
        if hashes == staged_hashes[:len(hashes)]:  # the usual case: all of it read from disk, in order
            return staged_kv.narrow(2, 0, len(hashes))
        parts, k = [], 0
        for h in hashes:
            if h in at:
                parts.append(staged_kv[:, :, at[h]:at[h] + 1])
            else:
                parts.append(host[:, :, k:k + 1])
                k += 1
        return torch.cat(parts, dim=2)

    def _wanted(self, seq: Sequence, num_hit_blocks: int) -> list[BlockHash]:
        return seq.block_hashes[num_hit_blocks:(seq.num_tokens - 1) // self.block_size]

    def demote(self, hashes: list[BlockHash], data) -> None:
        """Blocks leaving the pool, into the host tier (``data``: their KV, read before the
        step that reuses them), announced as the host tier's; what the host tier pushes out
        goes on to the disk tier, if any."""
        if self.disk is not None and self.write_through:
            self._to_disk(hashes, data)
        self._to_host(hashes, data)

    def _to_host(self, hashes: list[BlockHash], data) -> None:
        dropped = self.host.put(hashes, data, None if self.disk is None else self._to_disk)
        on_disk = [h for h in dropped if self.disk is not None and h in self.disk]
        held = [h for h in hashes if h in self.host]  # a batch larger than the tier keeps its last blocks
        self.pool.announce_tier(held, [h for h in dropped if h not in on_disk], MEDIUM_HOST)
        self.pool.announce_tier(on_disk, [], MEDIUM_DISK)

    def _to_disk(self, hashes: list[BlockHash], data) -> None:
        dropped = self.disk.put(hashes, data)
        self.pool.announce_tier([], [h for h in dropped if h not in self.host], MEDIUM_DISK)

    def awaiting_disk(self, seq: Sequence, num_hit_blocks: int) -> bool:
        """Whether the sequence's prefix, after the pool's hit, has blocks only the disk tier
        holds that are still being read: the first call starts the read (on the disk tier's
        thread) and says wait; once read, the blocks are staged for ``host_prefix`` and
        ``take_prefix``, and it says go."""
        if self.disk is None:
            return False
        future = self.fetches.get(seq.seq_id)
        if future is not None:
            if not future.done():
                return True
            del self.fetches[seq.seq_id]
            hashes, raw = future.result()
            self.poll_disk()
            if hashes:
                self.staged[seq.seq_id] = (hashes, self.disk.blocks(raw))
            return False
        if seq.seq_id in self.staged:
            return False
        wanted = self._wanted(seq, num_hit_blocks)
        start = self.host.leading(wanted)
        n = min(self.disk.leading(wanted[start:]), self.pool.num_blocks)
        if not n:
            return False
        self.fetches[seq.seq_id] = self.disk.fetch(wanted[start:start + n])
        return True

    def keep_on_disk(self, read_blocks) -> int:
        """At a clean stop: write what the pool caches and the host tier holds to the disk
        tier (``read_blocks``: block ids -> their KV), so a restart finds it; returns the
        blocks queued. Oldest first, so the LRU order survives too."""
        if self.disk is None or self.disk.closed:
            return 0
        host = [h for h in self.host.slots if h not in self.disk]
        if host:
            self.disk.put(host, self.host.take(host), bounded=False)
        pool = [(h, b.block_id) for h, b in self.pool.cached.items() if h not in self.disk]
        for k in range(0, len(pool), 256):
            run = pool[k:k + 256]
            self.disk.put([h for h, _ in run], read_blocks([b for _, b in run]).to("cpu"), bounded=False)
        return len(host) + len(pool)

    def poll_disk(self) -> None:
        """Forget the disk blocks found bad since the last call, and announce them gone."""
        if self.disk is not None:
            refused = self.disk.take_refused()
            self.pool.announce_tier([], [h for h in refused if h not in self.host], MEDIUM_DISK)

    def tier_blocks(self) -> dict[str, list[BlockHash]]:
        """What each tier behind the pool holds that no faster tier does (their part of a full
        dump): ``{"host": [...], "disk": [...]}``."""
        tiers = {}
        if self.host is not None:
            tiers[MEDIUM_HOST] = [h for h in self.host.slots if h not in self.pool.cached]
        if self.disk is not None:
            tiers[MEDIUM_DISK] = [h for h in self.disk.slots if h not in self.pool.cached and h not in self.host]
        return tiers

    def take_evictions(self) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of the cached blocks reused since the last call that pass the
        reuse gate: to demote before the step that overwrites them runs."""
        evicted, self.pool.evicted = self.pool.evicted, []
        if self.min_uses > 1:
            evicted = [(b, h) for b, h in evicted if self.uses.get(h, 0) >= self.min_uses]
        return evicted

    def count_use(self, seq: Sequence, uses: int = 1) -> None:
        """A request admitted (or, with ``uses`` = the gate, a sequence preempted): its full
        prompt blocks count one more use each."""
        if self.host is None or self.min_uses <= 1:
            return
        for h in seq.block_hashes[:seq.num_tokens // self.block_size]:
            self.uses[h] = self.uses.get(h, 0) + uses
            self.uses.move_to_end(h)
        while len(self.uses) > self.max_tracked:
            self.uses.popitem(last=False)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed: list[KVBlock] = ()) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the sequence's computed
        ones (plus ``computed`` prefix-hit blocks when admitting it)."""
        table = self.tables.setdefault(seq.seq_id, [])
        num_computed = seq.num_computed_tokens + len(computed) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = -(-total // self.block_size) - len(table) - len(computed)
        cow = self._shared_partial_block(table, num_computed)
        # cached hits with no other user sit in the free queue: taking them shrinks it
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if max(num_needed, 0) + (cow is not None) > self.pool.num_free_blocks - num_evictable_hits:
            if not table:
                del self.tables[seq.seq_id]
            return None
        if computed:
            self.pool.touch(list(computed))
            table.extend(computed)
            self.num_hashed[seq.seq_id] = len(table)
        if cow is not None:
            [fresh] = self.pool.get_new_blocks(1)
            self._copies.append(BlockCopy(table[cow].block_id, fresh.block_id))
            self.pool.free_blocks([table[cow]])
            table[cow] = fresh
        new_blocks = self.pool.get_new_blocks(num_needed) if num_needed > 0 else []
        table.extend(new_blocks)
        self._cache_full_blocks(seq, table, total)
        return new_blocks

    def _shared_partial_block(self, table: list[KVBlock], num_computed: int) -> int | None:
        index = num_computed // self.block_size
        if num_computed % self.block_size and index < len(table) and table[index].ref_cnt > 1:
            return index
        return None

    def _cache_full_blocks(self, seq: Sequence, table: list[KVBlock], num_tokens: int) -> None:
        rid = seq.seq_id
        start = self.num_hashed.get(rid, 0)
        end = min(num_tokens // self.block_size, len(seq.block_hashes))
        if end <= start:
            return
        parent = seq.block_hashes[start - 1] if start else None
        tokens = seq.token_ids[start * self.block_size:end * self.block_size]
        self.pool.cache_blocks(table[start:end], seq.block_hashes[start:end], parent, tokens)
        self.num_hashed[rid] = end

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares all of the parent's blocks (one more reference each)."""
        blocks = list(self.tables[parent.seq_id])
        self.pool.touch(blocks)
        self.tables[child.seq_id] = blocks
        self.num_hashed[child.seq_id] = self.num_hashed.get(parent.seq_id, 0)

    def free(self, seq: Sequence) -> None:
        self.fetches.pop(seq.seq_id, None)  # a read still running finishes unused
        self.staged.pop(seq.seq_id, None)
        table = self.tables.pop(seq.seq_id, [])
        self.num_hashed.pop(seq.seq_id, None)
        # tail first: a request's last blocks are the least likely to be shared, evict them first
        self.pool.free_blocks(list(reversed(table)))

    def take_copies(self) -> list[BlockCopy]:
        copies, self._copies = self._copies, []
        return copies

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def dump(self) -> tuple[int, list[BlockHash]]:
        return self.pool.dump()

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        self.pool.evicted.clear()
        if self.host is not None:
            self.host.clear()
        if self.disk is not None:
            self.disk.clear()
            self.fetches.clear()
            self.staged.clear()
        for rid in self.num_hashed:
            self.num_hashed[rid] = 0
