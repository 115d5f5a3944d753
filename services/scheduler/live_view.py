"""The scheduler's view of the live workers: made from a whole listing (``ListWorkers``) or
kept from the registry's ``WatchWorkers`` stream of changes.

At a thousand workers a listing is tens of ms at the registry and a message of them all;
the stream sends the whole set once, then only the workers that joined, changed load or
left. ``WorkerWatch`` applies each change to its workers at once and remakes the view (the
shortlist's orders) at most every ``remake_s``: a thousand heartbeats a second cost a
few dozen remakes, not a thousand."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import NamedTuple

import grpc

from services.common.convert import load_from_proto, worker_info_from_proto
from services.proto import kv_registry_pb2
from services.scheduler.placement import Candidate
from services.scheduler.shortlist import plain_order

log = logging.getLogger(__name__)


class View(NamedTuple):
    reported: list[Candidate]  # every live worker as its own report shows it (no match, nothing pending), by id
    order: dict[bool, list[Candidate]]  # the shortlist's walk order, by role (``shortlist.plain_order``)
    by_id: dict[str, Candidate]
    block_size: int  # one size across the mesh (checked at registration); 0 when no worker is live


def reported(worker: kv_registry_pb2.LiveWorker) -> Candidate:
    return Candidate.reported(worker_info_from_proto(worker.info), load_from_proto(worker.load))


def view_of(candidates: Iterable[Candidate], block_size: int) -> View:
    by_id = {c.worker_id: c for c in sorted(candidates, key=lambda c: c.worker_id)}
    listed = list(by_id.values())
    return View(listed, plain_order(listed), by_id, block_size if listed else 0)


def listed(workers: kv_registry_pb2.ListWorkersResponse) -> View:
    """A whole listing's view (ms of Python at a thousand workers: callers run it in a thread)."""
    return view_of(map(reported, workers.workers), workers.workers[0].info.block_size if workers.workers else 0)


EMPTY = view_of([], 0)


class WorkerWatch:
    """The live set from ``WatchWorkers``, reconnecting with backoff when the stream ends.
    ``current`` is None while the view cannot be vouched for: before the first whole set,
    when the stream has been silent for ``stale_after`` resyncs, or when the registry has
    no such call (an older one); the scheduler then lists instead."""

    def __init__(self, registry, remake_s: float = 0.02, stale_after: float = 4.0):
        self.registry = registry
        self.remake_s = remake_s
        self.stale_after = stale_after
        self.view = EMPTY
        self.heard_at = float("-inf")  # when the stream last sent anything
        self.resync_s = 1.0  # the registry's, from its messages
        self.unsupported = False
        self.streams = 0  # streams opened (reconnections included)
        self._workers: dict[str, Candidate] = {}
        self._block_size = 0
        self._whole = False  # a whole set has come on the current stream
        self._remake: asyncio.TimerHandle | None = None
        self._remade_at = float("-inf")
        self._first = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def current(self, timeout: float) -> View | None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        if not self._first.is_set():
            try:
                await asyncio.wait_for(asyncio.shield(self._first.wait()), timeout)
            except TimeoutError:
                return None
        fresh = time.monotonic() - self.heard_at <= self.stale_after * self.resync_s
        return self.view if fresh and self._whole and not self.unsupported else None

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._remake is not None:
            self._remake.cancel()

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            call = self.registry.WatchWorkers(kv_registry_pb2.WatchWorkersRequest())
            self.streams += 1
            try:
                async for message in call:
                    self._apply(message)
                    backoff = 0.1
                log.warning("the kv-registry ended its WatchWorkers stream; watching again")
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.warning("the kv-registry has no WatchWorkers: listing the live set instead")
                    self.unsupported = True
                    self._first.set()
                    return
                log.warning("WatchWorkers failed (%s: %s); watching again in %.1fs", err.code().name, err.details(),
                            backoff)
            except Exception:  # noqa: BLE001 - a message it could not apply: the watch goes on, listing meanwhile
                log.exception("the WatchWorkers stream failed; watching again in %.1fs", backoff)
            self._whole = False
            self._first.set()  # placements waiting for a first whole set list instead now
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, 2.0)

    def _apply(self, message: kv_registry_pb2.WatchWorkersResponse) -> None:
        self.heard_at = time.monotonic()
        self.resync_s = message.resync_s or self.resync_s
        if message.reset:
            self._workers.clear()
        for worker in message.updated:
            self._workers[worker.info.worker_id] = reported(worker)
            self._block_size = worker.info.block_size
        for wid in message.removed:
            self._workers.pop(wid, None)
        if message.reset:  # at once: the first whole set is what placements wait for
            self._whole = True
            self._remake_now()
            self._first.set()
        elif (message.updated or message.removed) and self._remake is None:
            delay = max(0.0, self._remade_at + self.remake_s - time.monotonic())
            self._remake = asyncio.get_running_loop().call_later(delay, self._remake_now)

    def _remake_now(self) -> None:
        if self._remake is not None:
            self._remake.cancel()
            self._remake = None
        self._remade_at = time.monotonic()
        self.view = view_of(self._workers.values(), self._block_size)
