"""``LeaseWatcher``: turns lease expiries in Redis into purges at the kv-registry (the
package's docstring says why both notifications and a reconciliation loop)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import redis.asyncio as redis
from prometheus_client import Counter

from services.common.worker_leases import leased_worker
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc

log = logging.getLogger(__name__)

LEASE_EXPIRIES = Counter("kervan_lease_expiries", "Worker leases that expired (each worker declared dead)")


class LeaseWatcher:
    """``client`` gives the notifications. A quiet mesh sends none, so the subscription
    is pinged when silent: a connection that answers nothing within ``silence_s`` is
    dropped and subscribed again (its reads never wait forever).

    Turning notifications on takes ``CONFIG SET``, which a least-privilege Redis user
    does not have: the watch then says so once and goes on with what the server has
    (``notify-keyspace-events Ex`` set by its operator, or the reconciliation loop alone)."""

    def __init__(self, client: redis.Redis, registry: kv_registry_pb2_grpc.KvRegistryServiceStub,
                 interval_s: float = 1.0, silence_s: float = 10.0):
        self.r = client
        self.registry = registry
        self.interval_s = interval_s
        self.silence_s = silence_s
        self.declared_dead: list[str] = []
        self.notifications_on: bool | None = None  # None: not known (no CONFIG GET permission)

    async def run(self) -> None:
        await asyncio.gather(self._notifications(), self._reconcile())

    async def _notifications(self) -> None:
        while True:
            pubsub = self.r.pubsub()
            try:
                await self._enable_notifications()
                await pubsub.psubscribe("__keyevent@*__:expired")
                await self._listen(pubsub)
            except (redis.ConnectionError, redis.TimeoutError, OSError, TimeoutError) as err:
                log.warning("Redis notifications lost (%s); subscribing again", err or type(err).__name__)
                await asyncio.sleep(min(self.interval_s, 1.0))
            finally:
                await pubsub.aclose()

    async def _enable_notifications(self) -> None:
        try:
            flags = str((await self.r.config_get("notify-keyspace-events")).get("notify-keyspace-events") or "")
            if not ("E" in flags and ("x" in flags or "A" in flags)):
                await self.r.config_set("notify-keyspace-events", flags + "Ex")
            self.notifications_on = True
        except redis.ResponseError as err:  # NOPERM for a least-privilege user, or CONFIG renamed away
            if self.notifications_on is not False:
                log.warning("cannot turn on Redis keyspace notifications (%s): dead workers are found by the "
                            "reconciliation loop every %.1fs; set notify-keyspace-events Ex on the server for "
                            "the fast path", err, self.interval_s)
            self.notifications_on = False

    async def _listen(self, pubsub) -> None:
        loop = asyncio.get_running_loop()
        heard = pinged = loop.time()
        while True:
            msg = await pubsub.get_message(timeout=min(self.interval_s, self.silence_s / 2))
            now = loop.time()
            if msg is not None:
                heard = now
                key = msg.get("data") if msg.get("type") == "pmessage" else None
                worker_id = leased_worker(key) if isinstance(key, bytes) else None
                if worker_id is not None:
                    log.warning("worker %s declared dead: its lease expired", worker_id)
                    LEASE_EXPIRIES.inc()
                    self.declared_dead.append(worker_id)
                    await self._purge()
            elif now - heard > self.silence_s:
                raise TimeoutError(f"the subscription answered nothing for {self.silence_s:.0f}s")
            elif now - max(heard, pinged) > self.silence_s / 2:
                await pubsub.ping()  # its pong is a message
                pinged = now

    async def _reconcile(self) -> None:
        while True:
            await self._purge()
            await asyncio.sleep(self.interval_s)

    async def _purge(self) -> None:
        try:
            await self.registry.PurgeExpired(kv_registry_pb2.PurgeExpiredRequest(), timeout=5)
        except grpc.aio.AioRpcError as err:
            log.warning("kv-registry unreachable: %s", err.code().name)
