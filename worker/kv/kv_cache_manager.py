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

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kervan.block_hash import BlockHash
from kervan.kv_events import KVEvent
from worker.batch import BlockCopy, KVWrite
from worker.kv.block_pool import BlockPool, KVBlock
from worker.kv.disk_tier import DiskTier
from worker.kv.host_tier import HostTier
from worker.kv.tiers import KVTiers
from worker.sequence import Sequence


class ComputedBlocks(NamedTuple):
    blocks: list[KVBlock]
    num_tokens: int


@dataclass
class Prefix:
    """Where an admitted sequence's leading blocks come from, in order: the pool's cache
    (``cached``), then the host or disk tier (``promoted``: copied back, not computed), or all
    of the prompt with the request (``imported``, the decode side of a KV handoff), or blocks
    another worker sent after the pool's hit (``fetched``, the cluster KV tier).
    ``num_tokens``: the tokens whose KV is there once they are placed (the first to compute)."""

    cached: ComputedBlocks
    num_tokens: int
    promoted: list[BlockHash] = field(default_factory=list)
    imported: torch.Tensor | None = None
    fetched: torch.Tensor | None = None

    @property
    def num_reused_tokens(self) -> int:
        """What the request reports as cached: the pool's and the tiers' tokens, not imported ones."""
        return self.cached.num_tokens if self.imported is not None else self.num_tokens


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, host: HostTier | None = None,
                 disk: DiskTier | None = None, write_through: bool = False, min_uses: int = 1):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size, enable_caching)
        # host memory (and disk) behind the pool, if any (``worker/kv/tiers.py``)
        self.tiers = KVTiers(self.pool, block_size, host, disk, write_through, min_uses) \
            if host is not None and enable_caching else None
        self.pool.track_evictions = self.tiers is not None
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

    def prefix(self, seq: Sequence) -> Prefix | None:
        """Where a waiting sequence's prefix comes from; None while a disk read it waits for is
        in flight (what only the disk tier holds is read first, while others run)."""
        cached = self.get_computed_blocks(seq)
        if seq.imported_kv is not None:  # the prompt's KV arrived with the request: only the next token is computed
            return Prefix(cached, seq.num_prompt_tokens, imported=seq.imported_kv)
        fetched = seq.fetched_kv
        if fetched is not None:  # blocks from another worker, used where they meet the pool's hit
            hit = len(cached.blocks)
            end = min(fetched.first_block + fetched.data.shape[2], (seq.num_tokens - 1) // self.block_size)
            if fetched.first_block <= hit < end:
                part = fetched.data.narrow(2, hit - fetched.first_block, end - hit)
                return Prefix(cached, end * self.block_size, fetched=part)
        if self.tiers is None:
            return Prefix(cached, cached.num_tokens)
        if self.tiers.awaiting_disk(seq, len(cached.blocks)):
            return None
        promoted = self.tiers.prefix(seq, len(cached.blocks))
        return Prefix(cached, cached.num_tokens + len(promoted) * self.block_size, promoted)

    def place(self, seq: Sequence, prefix: Prefix, num_new_tokens: int) -> list[KVWrite] | None:
        """Blocks for ``prefix`` and the ``num_new_tokens`` after it; the copies that fill the
        prefix's blocks not in the pool (imported, or from the tiers) before the step runs.
        None when the pool lacks the blocks: nothing is taken then."""
        cached = prefix.cached
        if self.allocate_slots(seq, prefix.num_tokens - cached.num_tokens + num_new_tokens, cached.blocks) is None:
            return None
        first = len(cached.blocks)
        blocks = self.get_block_ids(seq.seq_id)[first:]
        seq.fetched_kv = None  # used now, or never: a recompute after preemption computes every block
        if prefix.fetched is not None:
            return [KVWrite(blocks[:prefix.fetched.shape[2]], prefix.fetched)]
        if prefix.imported is not None:
            seq.imported_kv = None
            return [KVWrite(blocks[:prefix.imported.shape[2] - first], prefix.imported[:, :, first:])]
        writes = []
        if prefix.promoted and self.tiers is not None:
            for part in self.tiers.take(seq, prefix.promoted):  # runs of the tiers' slots, copied in place
                writes.append(KVWrite(blocks[:part.shape[2]], part))
                blocks = blocks[part.shape[2]:]
        return writes

    @property
    def host(self) -> HostTier | None:
        return None if self.tiers is None else self.tiers.host

    @property
    def disk(self) -> DiskTier | None:
        return None if self.tiers is None else self.tiers.disk

    def take_evictions(self) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of the cached blocks reused since the last call that pass the
        tiers' reuse gate: to demote before the step that overwrites them runs."""
        evicted, self.pool.evicted = self.pool.evicted, []
        return self.tiers.gate(evicted) if self.tiers is not None else []

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed: list[KVBlock] | tuple[()] = ()) -> list[KVBlock] | None:
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
        if self.tiers is not None:
            self.tiers.forget(seq)
        table = self.tables.pop(seq.seq_id, [])
        self.num_hashed.pop(seq.seq_id, None)
        # tail first: a request's last blocks are the least likely to be shared, evict them first
        self.pool.free_blocks(list(reversed(table)))

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free the blocks past those that cover the first ``num_tokens`` (the slots of a
        step's rejected speculative guesses: written, never hashed, reused by anyone)."""
        table = self.tables.get(seq.seq_id)
        keep = -(-num_tokens // self.block_size)
        if table is not None and len(table) > keep:
            extra = table[keep:]
            del table[keep:]
            self.pool.free_blocks(list(reversed(extra)))

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
        if self.tiers is not None:
            self.tiers.clear()
        for rid in self.num_hashed:
            self.num_hashed[rid] = 0
