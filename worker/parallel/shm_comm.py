# mypy: disable-error-code="attr-defined,index,union-attr"
"""Collectives for the ranks of a worker group on one CPU host, through shared memory.

gloo over loopback takes 1.4-2.1 ms per all-reduce here, even for 512 floats (a TCP
round trip is 28 us), and a tensor-parallel decode step needs two per layer. Like
vLLM's CPU shared-memory communicator, each rank instead copies its tensor into its
slot of one shared segment, raises its arrival counter, waits until every rank's
counter has arrived, and reads the others' slots. Every rank sums the slots in rank
order, so all ranks hold bit-identical results.

Two sets of slots alternate between calls, so one barrier per call is enough: a
rank writing call ``k + 2``'s slots has passed call ``k + 1``'s barrier, which no
rank reaches before it has read call ``k``. The counters are monotonic int64 words
on cache lines of their own; the data is stored before the counter, and x86's store
order keeps it so (the only CPU group backend tested here). Waiting spins, yielding
the core after a while; it gives up with a RuntimeError (the group is broken) as soon
as ``alive()`` says a rank is gone, or once it has waited the group timeout while no
other rank worked. Each rank says whether it works: a thread of its own stamps a
heartbeat into its counter's line every fraction of the timeout, and a rank that waits
says since when. A rank that is slow (emulated bf16 on a loaded core, a kernel probe)
keeps beating and is waited for; one that is stopped or wedged in native code stops
beating, and one deadlocked with the others waits itself, so either is taken for hung
within the timeout. Tensors larger than a slot go through the fallback collective
(gloo, whose own timeout is the group timeout).

Expert parallel's all-to-all (``exchange_rows``) is the same barrier: each rank writes
its rows, grouped by destination, with their counts in front, and each reads its
part of every slot. Pipeline stages (``pipeline=True``) instead pass tensors point to
point: one inbox per rank, with a counter of tensors put and one of tensors taken."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

LINE = 64  # bytes per arrival counter: one cache line each
# per rank and set: a decode step's tensors and a 2,048-token prefill chunk of a
# 768-wide float32 model fit (2 x 2 ranks x 8 MiB of /dev/shm, which Docker caps at 64 MiB)
SLOT_BYTES = 8 << 20


class ShmComm:
    def __init__(self, name: str, rank: int, world: int, slot_bytes: int, timeout_s: float, create: bool,
                 alive: Callable[[], bool] | None = None, pipeline: bool = False):
        """``pipeline``: the ranks are pipeline stages, which pass tensors point to point
        (one inbox per rank, ``send_to``/``recv``) and run no collectives (no slots for them)."""
        self.rank, self.world, self.slot_bytes, self.timeout_s = rank, world, slot_bytes, timeout_s
        self.alive = alive
        num_lines = 2 * world + 1 if pipeline else world + 1
        data_slots = world if pipeline else 2 * world
        size = num_lines * LINE + slot_bytes + data_slots * slot_bytes
        self.shm = shared_memory.SharedMemory(name=name, create=create, size=size if create else 0)
        # the creator unlinks the name once every rank has mapped it (``unlink``): no
        # segment outlives the group, however it ends; Python's tracker must not unlink it too
        if not create:
            resource_tracker.unregister(self.shm._name, "shared_memory")
        if create:
            self.shm.buf[:num_lines * LINE] = bytes(num_lines * LINE)
        lines = np.ndarray((num_lines, LINE // 8), dtype=np.int64, buffer=self.shm.buf)
        self.counters = lines[:world, 0]  # per rank: collectives arrived at; acks (messages read) in column 1
        self.acks = lines[:world, 1]
        self.beats = lines[:world, 2]  # per rank: time.monotonic_ns() of its last heartbeat
        self.waiting = lines[:world, 3]  # per rank: monotonic_ns since it waits for the others; 0 while it works
        self.message = lines[world]  # [0]: messages sent by rank 0, [1]: the last one's length (int64s)
        self.inbox_lines = lines[world + 1:]  # per rank (pipeline): [0] tensors put in its inbox, [1] taken
        self.payload = torch.frombuffer(self.shm.buf, dtype=torch.int64, offset=num_lines * LINE,
                                        count=slot_bytes // 8)
        slots = torch.frombuffer(self.shm.buf, dtype=torch.uint8, offset=num_lines * LINE + slot_bytes,
                                 count=data_slots * slot_bytes)
        self.data = slots.view(2, world, slot_bytes) if not pipeline else None
        self.inboxes = slots.view(world, slot_bytes) if pipeline else None
        self.header_bytes = -(-world * 8 // LINE) * LINE  # an exchange's row counts, before its rows
        self.calls = int(self.counters[rank])
        self.messages = int(self.message[0])
        self.taken = int(self.inbox_lines[rank, 1]) if pipeline else 0
        self.sent: dict[int, int] = {}  # pipeline: destination -> tensors put in its inbox
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._heartbeat = Heartbeat(self.beats, rank, timeout_s)

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    def fits_rows(self, max_rows: int, row_bytes: int) -> bool:
        return self.header_bytes + max_rows * row_bytes <= self.slot_bytes

    def exchange_rows(self, x: torch.Tensor, send_counts: list[int] | None) -> tuple[torch.Tensor, list[int]]:
        """All-to-all of rows (``send_counts``: rows for each rank, in rank order) or, with
        None, an all-gather of every rank's rows. Returns the rows this rank receives,
        source by source, and their counts. Each rank writes its counts and rows to its
        slot once; each reads its part of every slot."""
        self.calls += 1
        sets = self.data[self.calls % 2]  # [world, slot_bytes]
        mine = sets[self.rank]
        counts = send_counts if send_counts is not None else [len(x)]
        mine[:8 * len(counts)].view(torch.int64).copy_(torch.tensor(counts, dtype=torch.int64))
        flat = x.contiguous().view(-1).view(torch.uint8)
        mine[self.header_bytes:self.header_bytes + len(flat)].copy_(flat)
        self.counters[self.rank] = self.calls
        self._wait(self.calls)
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        row_shape = x.shape[1:]
        parts, received = [], []
        for src in range(self.world):
            header = sets[src, :self.header_bytes].view(torch.int64)
            if send_counts is None:
                skip, n = 0, int(header[0])
            else:
                src_counts = header[:self.world].tolist()
                skip, n = sum(src_counts[:self.rank]), src_counts[self.rank]
            start = self.header_bytes + skip * row_bytes
            parts.append(sets[src, start:start + n * row_bytes])
            received.append(n)
        rows = torch.cat(parts).view(x.dtype).view(sum(received), *row_shape)  # a copy out of the segment
        return rows, received

    def send_to(self, dst: int, x: torch.Tensor) -> None:
        """Pipeline: put ``x`` in rank ``dst``'s inbox, once it took the last one."""
        sent = self.sent.get(dst, int(self.inbox_lines[dst, 0]))
        line = self.inbox_lines[dst]
        self._wait_until(lambda: line[1] >= sent, f"rank {dst} to take a tensor")
        flat = x.contiguous().view(-1).view(torch.uint8)
        self.inboxes[dst, :len(flat)].copy_(flat)
        self.sent[dst] = sent + 1
        line[0] = sent + 1  # stored after the data (x86 keeps store order)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Pipeline: the next tensor in this rank's inbox (a copy)."""
        line = self.inbox_lines[self.rank]
        self.taken += 1
        self._wait_until(lambda: line[0] >= self.taken, "a tensor from the previous stage")
        nbytes = math.prod(shape) * dtype.itemsize
        out = self.inboxes[self.rank, :nbytes].clone().view(dtype).view(shape)
        line[1] = self.taken
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank the same bits: the same sum of the same slots)."""
        return x.copy_(self._exchange(x).sum(0).view(x.shape))

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.view(x.shape) for part in self._exchange(x)], dim=-1)

    def send(self, payload: torch.Tensor) -> None:
        """Rank 0: one int64 message to every other rank, once all have read the last."""
        if payload.numel() * 8 > self.slot_bytes:
            raise ValueError(f"message of {payload.numel()} int64 values exceeds the {self.slot_bytes}-byte slot")
        self._wait_until(lambda: all(self.acks[r] >= self.messages for r in range(1, self.world)), "read")
        self.payload[:payload.numel()].copy_(payload)
        self.message[1] = payload.numel()
        self.messages += 1
        self.message[0] = self.messages  # stored after the payload (x86 keeps store order)

    def receive(self, idle_sleep_s: float = 0.0005) -> torch.Tensor:
        """Ranks 1..N-1: the next message from rank 0 (a copy). Waits spinning while
        messages come fast, then sleeping (an idle group costs no core)."""
        self.messages += 1
        self._wait_until(lambda: self.message[0] >= self.messages, "send", idle_sleep_s)
        out = self.payload[:int(self.message[1])].clone()
        self.acks[self.rank] = self.messages
        return out

    def unlink(self) -> None:
        """Remove the segment's name (every rank has mapped it by now); the mappings stay."""
        self.shm.unlink()

    def close(self) -> None:
        self._heartbeat.stop()
        self._typed.clear()
        del self.data, self.inboxes, self.counters, self.acks, self.beats, self.waiting, self.message
        del self.inbox_lines, self.payload
        self.shm.close()

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Publish ``x``; returns [world, x.numel()], every rank's (a view into the segment,
        valid until the call after next)."""
        self.calls += 1
        n = x.numel()
        typed = self._typed.get(x.dtype)
        if typed is None:
            typed = self._typed[x.dtype] = self.data.view(x.dtype)  # [2, world, slot_bytes / itemsize]
        slots = typed[self.calls % 2, :, :n]
        slots[self.rank].copy_(x.reshape(-1))
        self.counters[self.rank] = self.calls
        self._wait(self.calls)
        return slots

    def _wait(self, call: int) -> None:
        counters = self.counters
        self._wait_until(lambda: all(counters[r] >= call for r in range(self.world)), f"collective {call}")

    def _wait_until(self, done: Callable[[], bool], what: str, idle_sleep_s: float = 0.0) -> None:
        spins, start = 0, None
        try:
            while not done():
                spins += 1
                if spins < 256:
                    continue  # the common case: another rank arrives within microseconds
                now = time.monotonic()
                if start is None:
                    start = now
                    self.waiting[self.rank] = time.monotonic_ns()
                if idle_sleep_s and now - start > 0.002:
                    time.sleep(idle_sleep_s)  # nothing came for 2 ms: idle, not between two steps
                else:
                    os.sched_yield()  # a core another rank may need
                if spins % 64 == 0:
                    if self.alive is not None and not self.alive():
                        raise RuntimeError(f"a rank of the worker group exited (waiting for {what})")
                    if now - start > self.timeout_s and not self.others_work():
                        raise RuntimeError(f"shared memory: waited {now - start:.0f}s for {what} while no other "
                                           f"rank worked for {self.timeout_s:g}s ({self.describe_others()}): "
                                           "a rank hangs")
        finally:
            if start is not None:
                self.waiting[self.rank] = 0

    def others_work(self) -> bool:
        """Whether another rank beat within the timeout and is not itself waiting: while
        one does, the group still moves, however slowly."""
        fresh = time.monotonic_ns() - int(self.timeout_s * 1e9)
        return any(int(self.beats[r]) > fresh and int(self.waiting[r]) == 0
                   for r in range(self.world) if r != self.rank)

    def describe_others(self) -> str:
        now = time.monotonic_ns()
        parts = []
        for r in range(self.world):
            if r != self.rank:
                since = int(self.waiting[r])
                state = f"waiting {(now - since) / 1e9:.0f}s" if since else "not waiting"
                parts.append(f"rank {r}: last heartbeat {(now - int(self.beats[r])) / 1e9:.1f}s ago, {state}")
        return "; ".join(parts)


class Heartbeat:
    """A daemon thread that stamps ``time.monotonic_ns()`` (one clock for every process of
    the host) into ``beats[rank]`` several times per timeout. It needs the GIL only for
    microseconds, which PyTorch's kernels release and a Python loop yields every few ms,
    so it beats while its rank computes and stops when the process is stopped or hangs
    holding the GIL."""

    def __init__(self, beats: np.ndarray, rank: int, timeout_s: float):
        self.beats, self.rank = beats, rank
        self.interval_s = min(1.0, timeout_s / 4)
        self._stopped = threading.Event()
        self.beats[rank] = time.monotonic_ns()
        self._thread = threading.Thread(target=self._run, name=f"kervan-group-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self.beats[self.rank] = time.monotonic_ns()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
        del self.beats  # the segment can close only once no view of it is left
