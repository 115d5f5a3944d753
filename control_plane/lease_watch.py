"""``python -m control_plane.lease_watch``: the control plane's watch over worker leases.

Workers hold leases in Redis (``kervan:w:{id}``, renewed by their heartbeats). This
process declares a worker dead the moment its lease expires — Redis keyspace
notifications (``notify-keyspace-events Ex``, set here) say so at once — and has the
kv-registry purge it through its API (``PurgeExpired`` drops every expired worker
and its KV ownership), so that the scheduler, which reads the live set for every
placement, stops choosing it at once. A reconciliation loop every ``--interval``
seconds does the same whether or not a notification arrived: notifications are a
fast path, the loop is the source of truth (Redis does not queue notifications
for a subscriber that was disconnected)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import grpc
import redis.asyncio as redis
from prometheus_client import Counter

from services.common import redis_url
from services.common.config import parse_service_args, service_parser
from services.common.metrics import serve_metrics
from services.common.security import MeshSecurity
from services.common.worker_leases import leased_worker
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc

log = logging.getLogger(__name__)


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
            flags = (await self.r.config_get("notify-keyspace-events")).get("notify-keyspace-events", "")
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


LEASE_EXPIRIES = Counter("kervan_lease_expiries", "Worker leases that expired (each worker declared dead)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = service_parser("control_plane.lease_watch", __doc__, listens=False)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0",
                    help="Redis URL (a password: in KERVAN_CONTROL_PLANE_REDIS rather than on the command line)")
    ap.add_argument("--registry", required=True, help="HOST:PORT of the kv-registry")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between reconciliations")
    return parse_service_args(ap, "control_plane", argv)


async def serve(args: argparse.Namespace) -> None:
    security = MeshSecurity.from_args(args)
    client = redis_url.connect(args.redis)
    async with security.channel(args.registry, role="kv-registry") as channel:
        watcher = LeaseWatcher(client, kv_registry_pb2_grpc.KvRegistryServiceStub(channel), args.interval)
        task = asyncio.ensure_future(watcher.run())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        serve_metrics(args.metrics_port, args.host, "control-plane")
        print("control-plane membership watch ready", flush=True)
        try:
            await task
        except asyncio.CancelledError:
            log.info("stopping")
        finally:
            await client.aclose()


def main(argv: list[str] | None = None) -> None:
    from services.common.server import run_service
    args = parse_args(argv)
    run_service("kervan-lease-watch", lambda: serve(args))


if __name__ == "__main__":
    main()
