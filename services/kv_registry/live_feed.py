"""The live set's changes as a stream (``WatchWorkers``): a scheduler keeps its view of a
thousand workers from the few that changed, instead of listing them all for each placement.

The scripts that register, renew or drop a worker publish its id on ``LIVE_CHANNEL``. The
feed listens there, and ``flush_s`` after the first id it reads those workers' leases (one
pipeline) and sends the ones that changed (a renewal with the same load changes nothing)
and the ones gone. Pub/sub delivers at most once and an expiring lease publishes nothing,
so every ``resync_s`` the feed reads the whole live set, as ``ListWorkers`` does, and sends
what differs from what it sent, or an empty message: the stream's sign of life. While a
Redis that restarted empty is rebuilt (``Generations``), the workers not back yet stay, as
``ListWorkers`` keeps them.

Each watcher gets the whole set first, then every change in order; one that falls
``queue_size`` messages behind gets the whole set again instead of the backlog. The feed
follows Redis only while someone watches: the first watcher starts it, the last one's
leaving stops it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import redis.asyncio as redis

from services.common.convert import load_to_proto, worker_info_to_proto
from services.common.errors import Overloaded, Unavailable
from services.kv_registry.generation import Generations
from services.kv_registry.index import LEASE_PREFIX, PrefixIndex, decode_live
from services.kv_registry.scripts import LIVE_CHANNEL
from services.proto import kv_registry_pb2

log = logging.getLogger(__name__)
BEHIND = object()  # in a watcher's queue: it fell behind, send it the whole set
STOP = object()  # the registry is stopping: end the stream
DECODE_IN_THREAD = 64  # changed leases decoded off the event loop from this many (a resync after a restart)


def decoded(leases: list[tuple[str, list]]) -> list[kv_registry_pb2.LiveWorker]:
    return [kv_registry_pb2.LiveWorker(info=worker_info_to_proto(record), load=load_to_proto(load))
            for record, load in decode_live(leases)]


class LiveFeed:
    def __init__(self, index: PrefixIndex, generations: Generations, resync_s: float = 0.5, flush_s: float = 0.005,
                 max_watchers: int = 64, queue_size: int = 256, ready_timeout_s: float = 5.0):
        self.index = index
        self.generations = generations
        self.resync_s = resync_s
        self.flush_s = flush_s
        self.max_watchers = max_watchers
        self.queue_size = queue_size
        self.ready_timeout_s = ready_timeout_s
        self._leases: dict[str, list] = {}  # worker id -> its lease hash, flattened, as last sent
        self._workers: dict[str, kv_registry_pb2.LiveWorker] = {}  # as last sent
        self._watchers: set[asyncio.Queue] = set()
        self._dirty: set[str] = set()
        self._ready = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopped = False

    async def watch(self) -> AsyncIterator[kv_registry_pb2.WatchWorkersResponse]:
        if self._stopped:
            raise Unavailable("the kv-registry is stopping")
        if len(self._watchers) >= self.max_watchers:
            raise Overloaded(f"{len(self._watchers)} watchers already follow this kv-registry (at most "
                             f"{self.max_watchers})")
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            await asyncio.wait_for(self._ready.wait(), self.ready_timeout_s)
        except TimeoutError:
            raise Unavailable("the kv-registry cannot read the live set from Redis") from None
        queue: asyncio.Queue = asyncio.Queue(self.queue_size)
        self._watchers.add(queue)
        try:
            yield self._whole()
            while True:
                message = await queue.get()
                if message is STOP:
                    return
                if message is BEHIND:
                    while not queue.empty():  # the whole set supersedes them (applied after it, they would regress it)
                        if queue.get_nowait() is STOP:
                            return
                    message = self._whole()
                yield message
        finally:
            self._watchers.discard(queue)
            if not self._watchers:
                self._idle()

    def _idle(self) -> None:
        """The last watcher left: stop following Redis (no resync every ``resync_s`` for
        nobody); the next watcher reads the whole set afresh."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._ready.clear()
        self._leases.clear()
        self._workers.clear()
        self._dirty.clear()

    def close(self) -> None:
        """Ends every stream (a draining registry must not wait its grace on them)."""
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
        for queue in self._watchers:
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(STOP)

    def _whole(self) -> kv_registry_pb2.WatchWorkersResponse:
        return kv_registry_pb2.WatchWorkersResponse(reset=True, updated=self._workers.values(),
                                                    resync_s=self.resync_s)

    def _send(self, message: kv_registry_pb2.WatchWorkersResponse) -> None:
        for queue in self._watchers:
            if queue.full():
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(BEHIND)
            else:
                queue.put_nowait(message)

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                async with self.index.r.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(LIVE_CHANNEL)
                    await self._follow(pubsub)
            except (redis.RedisError, OSError) as err:
                log.warning("the live feed lost Redis (%s); reading the whole live set again in %.1fs", err, backoff)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 2.0)

    async def _follow(self, pubsub) -> None:
        await self._resync()  # subscribed first: no change between the read and the channel is missed
        self._ready.set()
        next_resync, flush_at = time.monotonic() + self.resync_s, 0.0
        while True:
            now = time.monotonic()
            if now >= next_resync:
                await self._resync()
                next_resync = time.monotonic() + self.resync_s
                continue
            if self._dirty and now >= flush_at:
                await self._flush()
                continue
            until = min(next_resync, flush_at) if self._dirty else next_resync
            message = await pubsub.get_message(timeout=max(0.0, until - now))
            if message is not None and message["type"] == "message":
                if not self._dirty:
                    flush_at = time.monotonic() + self.flush_s
                self._dirty.add(message["data"].decode())

    async def _flush(self) -> None:
        ids = sorted(self._dirty)
        self._dirty.clear()
        async with self.index.r.pipeline(transaction=False) as pipe:
            for wid in ids:
                pipe.hgetall(LEASE_PREFIX + wid)
            leases = await pipe.execute()
        await self._apply({wid: [x for kv in lease.items() for x in kv] for wid, lease in zip(ids, leases)},
                          heartbeat=False)

    async def _resync(self) -> None:
        await self.generations.check()
        self._dirty.clear()  # the whole read is newer than any id heard before it
        live = dict(await self.index.registered())
        await self._apply({wid: live.get(wid) or [] for wid in live.keys() | self._leases.keys()}, heartbeat=True)

    async def _apply(self, leases: dict[str, list], heartbeat: bool) -> None:
        """Sends the workers among ``leases`` whose lease differs from the one last sent, and
        those gone (an empty lease), unless Redis is being rebuilt; ``heartbeat``: send even
        an empty message."""
        changed = sorted((wid, flat) for wid, flat in leases.items() if flat and flat != self._leases.get(wid))
        gone = [wid for wid, flat in leases.items() if not flat and wid in self._leases]
        if gone and not self.generations.rebuilding:
            await self.generations.check(force=True)  # workers gone: a cached check would miss an empty Redis
        if gone and self.generations.rebuilding:
            gone = []
        updated = await asyncio.to_thread(decoded, changed) if len(changed) >= DECODE_IN_THREAD else \
            decoded(changed)
        for (wid, flat), worker in zip(changed, updated):
            self._leases[wid] = flat
            self._workers[wid] = worker
        for wid in gone:
            del self._leases[wid], self._workers[wid]
        if updated or gone or heartbeat:
            self._send(kv_registry_pb2.WatchWorkersResponse(updated=updated, removed=sorted(gone),
                                                            resync_s=self.resync_s))
