"""The pool of KV blocks: reference counts, the free queue, the prefix-cache map.

A block is in exactly one of three states:

    in use      ref_cnt > 0                     (maybe hashed: shared prefix)
    cached      ref_cnt == 0, hashed, in free queue   (reusable on a prefix hit)
    free        ref_cnt == 0, no hash, in free queue

The free queue is also the eviction order: new blocks are taken from its head,
freed blocks join its tail, so the least recently used cached block is evicted
first. Taking a cached block off the head forgets its hash (``BlockRemoved``); a
prefix hit on a cached block lifts it out of the queue wherever it is."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kervan.block_hash import BlockHash
from kervan.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self._events: list[KVEvent] = []
        self._seq = 0
        self.num_evictable = 0  # free blocks still holding cached KV (evicting them loses a prefix)
        # with a tier behind the pool: (block id, hash) of each cached block taken for reuse, whose
        # contents stay intact until the step that reuses it runs
        self.track_evictions = False
        self.evicted: list[tuple[int, BlockHash]] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > len(self.free_queue):
            raise ValueError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out, evicted = [], []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                self.num_evictable -= 1
                evicted.append(block.block_hash)
                if self.track_evictions:
                    self.evicted.append((block.block_id, block.block_hash))
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self._emit(BlockRemoved(self._next_seq(), evicted))
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on blocks found by a prefix hit or shared by a fork."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
                self.num_evictable -= block.block_hash is not None
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the tail of the free queue
        in the given order (callers pass a request's blocks tail first)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                self.num_evictable += block.block_hash is not None
            elif block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")

    def cache_blocks(self, blocks: list[KVBlock], hashes: list[BlockHash], parent: BlockHash | None,
                     token_ids: list[int]) -> None:
        """Register newly full blocks under their hashes and announce them. A hash
        already held by another block (two requests computed the same prefix at
        once) stays with its first holder; the duplicate is simply not cached."""
        if not self.enable_caching:
            return
        run: list[BlockHash] = []  # consecutive newly cached blocks, announced together
        for i, (block, h) in enumerate(zip(blocks, hashes)):
            if h in self.cached or block.block_hash is not None:
                self._announce(run, parent, token_ids, i)
                run, parent = [], h
                continue
            block.block_hash = h
            self.cached[h] = block
            run.append(h)
        self._announce(run, parent, token_ids, len(blocks))

    def _announce(self, run: list[BlockHash], parent: BlockHash | None, token_ids: list[int], end: int) -> None:
        if run:
            tokens = token_ids[(end - len(run)) * self.block_size:end * self.block_size]
            self._emit(BlockStored(self._next_seq(), run, parent, tokens, self.block_size))

    def announce_tier(self, stored: list[BlockHash], removed: list[BlockHash], medium: str) -> None:
        """Events of a tier behind the pool: blocks it now holds, blocks it dropped that the
        pool does not hold either (the pool's own events speak for the ones it does)."""
        removed = [h for h in removed if h not in self.cached]
        if removed:
            self._emit(BlockRemoved(self._next_seq(), removed, medium))
        if stored:
            self._emit(BlockStored(self._next_seq(), list(stored), None, [], self.block_size, medium))

    def reset_prefix_cache(self) -> None:
        """Forget every hash (in-use blocks keep their contents, just not their names)."""
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self.num_evictable = 0
        self._emit(AllBlocksCleared(self._next_seq()))

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """Invariants, for tests: the free queue holds exactly the unreferenced blocks,
        and the cache map and the blocks' own hashes agree."""
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.ref_cnt == 0) == (block.block_id in self.free_queue), block
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, block
        for h, block in self.cached.items():
            assert block.block_hash == h
        assert self.num_evictable == sum(b.block_hash is not None for b in self.free_queue.values())

    def dump(self) -> tuple[int, list[BlockHash]]:
        """Every cached block, as of the last event's sequence number. Events not yet
        taken are dropped: the dump supersedes them."""
        self._events.clear()
        return self._seq, list(self.cached)

    def _emit(self, event: KVEvent) -> None:
        self._events.append(event)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq
