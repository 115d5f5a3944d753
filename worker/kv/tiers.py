"""The tiers behind the engine's KV pool: host memory (``HostTier``), then local disk
(``DiskTier``), and the rules that move blocks between them and the pool.

    pool --evicted, past the reuse gate--> host --pushed out (write-back)--> disk
      ^                                     |  \\__ every demoted block too (write-through)
      |                                     v
      +------ a prompt's prefix: host blocks copied back, disk blocks read first ------+

Every move is announced as the pool's KV events, tier by tier (``BlockStored`` /
``BlockRemoved`` with ``medium``), so the registry knows which tier holds each block:
the fastest one that does. Disk reads run on the disk tier's thread; a sequence whose
prefix is being read waits in the queue (``awaiting_disk``) while others run."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from concurrent import futures

import torch

from kervan.block_hash import BlockHash
from kervan.kv_events import MEDIUM_DISK, MEDIUM_HOST
from worker.kv.block_pool import BlockPool
from worker.kv.disk_tier import DiskTier
from worker.kv.host_tier import BlockFill, HostTier
from worker.kv.slots import consecutive_runs
from worker.sequence import Sequence


class KVTiers:
    def __init__(self, pool: BlockPool, block_size: int, host: HostTier, disk: DiskTier | None = None,
                 write_through: bool = False, min_uses: int = 1):
        self.pool = pool
        self.block_size = block_size
        self.host = host
        # tier 2 behind the host tier: blocks the host tier pushes out are written there
        # (write-back), or every block demoted is written there at once too (write-through)
        self.disk = disk
        self.write_through = write_through
        # the reuse gate: a block leaves the pool for the tiers only once this many requests used
        # it (1: every block), so a scan of one-off prompts cannot flush the tiers' hot set; a
        # preempted sequence's blocks always pass (it resumes). Uses are counted per hash, for
        # the most recent hashes only (a bounded map, least recently used out).
        self.min_uses = min_uses
        self.uses: OrderedDict[BlockHash, int] = OrderedDict()
        self.max_tracked = 4 * (len(pool.blocks) + host.num_blocks + (disk.num_blocks if disk is not None else 0))
        self.fetches: dict[str, futures.Future] = {}  # sequence id -> its prefix's blocks being read from disk
        # sequence id -> the blocks read from disk for it: their hashes, their KV [layers, 2, n, ...]
        self.staged: dict[str, tuple[list[BlockHash], torch.Tensor]] = {}
        self.lent: set[BlockHash] = set()  # host blocks ``take`` handed out as views this step
        if disk is not None and len(disk):  # found again at start: the registry hears of them first
            pool.announce_tier(list(disk.slots), [], MEDIUM_DISK)

    # -- a prompt's prefix, back into the pool --------------------------------------

    def prefix(self, seq: Sequence, num_hit_blocks: int) -> list[BlockHash]:
        """The hashes of the blocks after a pool hit that the tiers have ready to copy back
        (leading ones, leaving the last prompt token to compute): held by the host tier, or
        read from disk for this sequence (``awaiting_disk``)."""
        staged = self.staged.get(seq.seq_id, ((), None))[0]
        n = 0
        for h in self._wanted(seq, num_hit_blocks):
            if h not in staged and h not in self.host:
                break
            n += 1
        return seq.block_hashes[num_hit_blocks:num_hit_blocks + n]

    def take(self, seq: Sequence, hashes: list[BlockHash]) -> list[torch.Tensor]:
        """The KV of ``prefix``'s blocks, in parts whose concatenation along dim 2 is
        ``[layers, 2, len(hashes), ...]``: runs of what was read from disk for the sequence,
        and views of the host tier's slots, lent until this step's ``demote`` (the step
        writes them into the pool before any later demotion can reuse those slots)."""
        staged_hashes, staged_kv = self.staged.pop(seq.seq_id, ([], None))
        at = {h: k for k, h in enumerate(staged_hashes)}
        parts: list[torch.Tensor] = []
        for from_disk, run in itertools.groupby(hashes, key=lambda h: h in at):
            group = list(run)
            if from_disk and staged_kv is not None:
                positions = [at[h] for h in group]
                parts += [staged_kv.narrow(2, positions[k], n) for k, n in consecutive_runs(positions)]
            else:
                self.lent.update(group)
                parts += self.host.take_runs(group)
        return parts

    def awaiting_disk(self, seq: Sequence, num_hit_blocks: int) -> bool:
        """Whether the sequence's prefix, after the pool's hit, has blocks only the disk tier
        holds that are still being read: the first call starts the read (on the disk tier's
        thread) and says wait; once read, the blocks are staged for ``prefix`` and ``take``,
        and it says go."""
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
        n = min(self.disk.leading(wanted[start:]), len(self.pool.blocks))
        if not n:
            return False
        self.fetches[seq.seq_id] = self.disk.fetch(wanted[start:start + n])
        return True

    def wait_for_reads(self, timeout: float) -> None:
        """Block until a disk read ends, ``timeout`` seconds at most (when nothing else can run)."""
        futures.wait(list(self.fetches.values()), timeout=timeout, return_when=futures.FIRST_COMPLETED)

    def _wanted(self, seq: Sequence, num_hit_blocks: int) -> list[BlockHash]:
        return seq.block_hashes[num_hit_blocks:(seq.num_tokens - 1) // self.block_size]

    # -- blocks leaving the pool, down the tiers ------------------------------------

    def gate(self, evicted: list[tuple[int, BlockHash]]) -> list[tuple[int, BlockHash]]:
        """Of the (block id, hash) pairs the pool let go, those past the reuse gate."""
        if self.min_uses <= 1:
            return evicted
        return [(b, h) for b, h in evicted if self.uses.get(h, 0) >= self.min_uses]

    def count_use(self, seq: Sequence, resumes: bool = False) -> None:
        """A request admitted: its full prompt blocks count one more use each; a sequence
        preempted (``resumes``): its blocks pass the gate at once."""
        if self.min_uses <= 1:
            return
        for h in seq.block_hashes[:seq.num_tokens // self.block_size]:
            self.uses[h] = self.uses.get(h, 0) + (self.min_uses if resumes else 1)
            self.uses.move_to_end(h)
        while len(self.uses) > self.max_tracked:
            self.uses.popitem(last=False)

    def demote(self, hashes: list[BlockHash], fill: BlockFill) -> None:
        """Blocks leaving the pool, given in eviction order, into the host tier (``fill``
        writes their KV straight into its slots, before the step that reuses the blocks
        runs), announced as the host tier's; what the host tier pushes out goes on to the
        disk tier, if any, and with write-through every block demoted does. Called once a
        step, with or without blocks: it ends the loan of ``take``'s views."""
        spill: Callable | None = None if self.disk is None else self._to_disk
        dropped = self.host.store(hashes, fill, spill, self.lent) if hashes else []
        self.lent.clear()
        if not hashes:
            return
        held = [h for h in hashes if h in self.host]  # a batch larger than the tier keeps its last blocks
        if self.disk is not None and self.write_through:
            written = [h for h in held if h not in self.disk]
            if written:
                self._to_disk(written, self.host.view(written))
        on_disk = [h for h in dropped if self.disk is not None and h in self.disk]
        self.pool.announce_tier(held, [h for h in dropped if h not in on_disk], MEDIUM_HOST)
        self.pool.announce_tier(on_disk, [], MEDIUM_DISK)

    def _to_disk(self, hashes: list[BlockHash], data: torch.Tensor) -> None:
        assert self.disk is not None  # only a tier with a disk behind it writes through
        dropped = self.disk.put(hashes, data)
        self.pool.announce_tier([], [h for h in dropped if h not in self.host], MEDIUM_DISK)

    def poll_disk(self) -> None:
        """Forget the disk blocks found bad since the last call, and announce them gone."""
        if self.disk is not None:
            refused = self.disk.take_refused()
            self.pool.announce_tier([], [h for h in refused if h not in self.host], MEDIUM_DISK)

    def keep_on_disk(self, read_blocks: Callable[[list[int]], torch.Tensor]) -> int:
        """At a clean stop: write what the pool caches and the host tier holds to the disk
        tier (``read_blocks``: block ids -> their KV), so a restart finds it; returns the
        blocks queued. Oldest first, so the LRU order survives too."""
        if self.disk is None or self.disk.closed:
            return 0
        host = [h for h in self.host.slots if h not in self.disk]
        if host:
            self.disk.put(host, self.host.view(host), bounded=False)
        pool = [(h, b.block_id) for h, b in self.pool.cached.items() if h not in self.disk]
        for k in range(0, len(pool), 256):
            run = pool[k:k + 256]
            self.disk.put([h for h, _ in run], read_blocks([b for _, b in run]).to("cpu"), bounded=False)
        return len(host) + len(pool)

    # -- what they hold -------------------------------------------------------------

    def blocks(self) -> dict[str, list[BlockHash]]:
        """What each tier holds that no faster tier does (their part of a full dump):
        ``{"host": [...], "disk": [...]}``."""
        tiers = {MEDIUM_HOST: [h for h in self.host.slots if h not in self.pool.cached]}
        if self.disk is not None:
            tiers[MEDIUM_DISK] = [h for h in self.disk.slots if h not in self.pool.cached and h not in self.host]
        return tiers

    def forget(self, seq: Sequence) -> None:
        """A sequence freed: a read still running for it finishes unused."""
        self.fetches.pop(seq.seq_id, None)
        self.staged.pop(seq.seq_id, None)

    def clear(self) -> None:
        self.host.clear()
        if self.disk is not None:
            self.disk.clear()
        self.fetches.clear()
        self.staged.clear()
