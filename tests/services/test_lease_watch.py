"""The control plane declares a worker dead when its lease expires — at once, from
Redis's keyspace notification, without waiting for anyone to read the live set."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import grpc

from control_plane.lease_watch.watcher import LeaseWatcher
from kervan.block_hash import HASH_NAME
from kervan.kv_events import BlockStored
from kervan.sampling import RequestLimits
from kervan.worker_info import WorkerInfo, WorkerRole
from services.kv_registry.index import PrefixIndex
from services.proto import kv_registry_pb2_grpc
from tests.chaos.fault_proxy import FaultProxy
from tests.services.conftest import start_registry

WORKER = WorkerInfo(worker_id="w", address="127.0.0.1:1", role=WorkerRole.DECODE, model="m", block_size=16,
                      hash_name=HASH_NAME, limits=RequestLimits(max_model_len=4096, max_n=16))


async def until(predicate, what: str, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


@asynccontextmanager
async def watching(index: PrefixIndex, redis_client, interval_s: float, watch_client=None, silence_s: float = 10.0):
    """A kv-registry on ``index`` and a lease watcher over it (on ``watch_client``, by
    default the registry's own), running."""
    registry = await start_registry(index)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{registry.port}")
    watcher = LeaseWatcher(watch_client or redis_client, kv_registry_pb2_grpc.KvRegistryServiceStub(channel),
                           interval_s=interval_s, silence_s=silence_s)
    task = asyncio.create_task(watcher.run())
    try:
        yield watcher
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await channel.close()
        await registry.stop(0)


async def test_an_expired_lease_is_purged_at_once(redis_client):
    index = PrefixIndex(redis_client, ttl_s=1)
    async with watching(index, redis_client, interval_s=3600) as watcher:  # reconciles once, then notifications
        token = await index.register(WorkerInfo(worker_id="w", address="127.0.0.1:1", role=WorkerRole.DECODE, model="m",
                                                  block_size=16, hash_name=HASH_NAME,
                                                  limits=RequestLimits(max_model_len=4096, max_n=16)))
        await index.apply("w", token, [BlockStored(1, [b"\x01" * 32, b"\x02" * 32], None, [], 16)])
        assert await redis_client.hlen("kervan:own:w") == 2
        for _ in range(100):  # the lease (1 s) expires; nobody heartbeats, nobody lists workers
            if not await redis_client.sismember("kervan:workers", "w"):
                break
            await asyncio.sleep(0.05)
        assert watcher.declared_dead == ["w"]
        await until(lambda: _swept(redis_client), "its blocks swept", timeout=30)  # in the background
        assert not await redis_client.exists("kervan:own:w") and not await redis_client.keys("kervan:blk:*")


async def test_the_reconciliation_loop_purges_an_expired_worker_without_any_notification(redis_client):
    index = PrefixIndex(redis_client, ttl_s=1)
    async with watching(index, redis_client, interval_s=0.2) as watcher:
        # the watcher turned notifications on and subscribed; then Redis stops notifying (as after a
        # restart). Waits are generous (a loaded CI machine): they bound the test, not the watcher
        await until(lambda: redis_client.execute_command("PUBSUB", "NUMPAT"), "subscribed", timeout=30)
        await redis_client.config_set("notify-keyspace-events", "")
        token = await index.register(WorkerInfo(worker_id="w", address="127.0.0.1:1", role=WorkerRole.DECODE, model="m",
                                                  block_size=16, hash_name=HASH_NAME,
                                                  limits=RequestLimits(max_model_len=4096, max_n=16)))
        await index.apply("w", token, [BlockStored(1, [b"\x01" * 32], None, [], 16)])
        # the lease (1 s) expires; only the loop (every 0.2 s) can notice
        await until(lambda: _false(redis_client.sismember("kervan:workers", "w")), "purged", timeout=30)
        assert watcher.declared_dead == []  # no notification arrived
        # its block bits are swept in the background after the purge (a batch per script call)
        await until(lambda: _swept(redis_client), "its blocks swept", timeout=30)
        assert not await redis_client.sismember("kervan:workers", "w")
        assert not await redis_client.exists("kervan:own:w") and not await redis_client.keys("kervan:blk:*")


async def test_a_least_privilege_redis_user_still_gets_dead_workers_purged(redis_client, redis_server, caplog):
    """The README's ACL user cannot run CONFIG: the watch says so once and does not crash;
    with notifications turned on by the operator it purges at once, from the notification."""
    import redis.asyncio as redis
    await redis_client.execute_command("ACL", "SETUSER", "kervan-watch", "on", ">watch-pw", "~*", "&*", "+@all",
                                       "-@dangerous")
    await redis_client.config_set("notify-keyspace-events", "Ex")  # the operator's redis.conf
    port = redis_server.rsplit(":", 1)[1].split("/")[0]
    limited = redis.Redis.from_url(f"redis://kervan-watch:watch-pw@127.0.0.1:{port}/0")
    index = PrefixIndex(redis_client, ttl_s=1)
    try:
        async with watching(index, redis_client, interval_s=3600, watch_client=limited) as watcher:
            await until(lambda: redis_client.execute_command("PUBSUB", "NUMPAT"), "subscribed")
            assert watcher.notifications_on is False
            await index.register(WORKER)
            await until(lambda: _false(redis_client.sismember("kervan:workers", "w")), "purged")
            assert watcher.declared_dead == ["w"]  # the notification, not the (hourly) loop
        assert sum("cannot turn on Redis keyspace notifications" in r.message for r in caplog.records) == 1
    finally:
        await limited.aclose()
        await redis_client.execute_command("ACL", "DELUSER", "kervan-watch")


async def test_a_subscription_that_goes_silent_is_dropped_and_made_again(redis_client, redis_server, caplog):
    """A network that drops everything leaves a subscription waiting forever unless it is
    pinged: the watch finds the silence, subscribes again, and notifications flow again."""
    import redis.asyncio as redis
    proxy = await FaultProxy(int(redis_server.rsplit(":", 1)[1].split("/")[0])).start()
    through = redis.Redis.from_url(f"redis://127.0.0.1:{proxy.port}/0", socket_timeout=2)
    index = PrefixIndex(redis_client, ttl_s=1)
    try:
        async with watching(index, redis_client, interval_s=3600, watch_client=through, silence_s=1.0) as watcher:
            await until(lambda: redis_client.execute_command("PUBSUB", "NUMPAT"), "subscribed")
            proxy.mode = "blackhole"
            await until(lambda: _true(any("subscribing again" in r.message for r in caplog.records)),
                        "the silence found")
            proxy.reset()  # the old connection goes (Redis still counted its subscription)
            proxy.mode = "pass"
            await until(lambda: redis_client.execute_command("PUBSUB", "NUMPAT"), "subscribed again")
            await index.register(WORKER)
            await until(lambda: _true(watcher.declared_dead == ["w"]), "declared dead from a notification")
    finally:
        await through.aclose()
        await proxy.stop()


async def _swept(redis_client) -> bool:
    return not await redis_client.exists("kervan:own:w") and not await redis_client.keys("kervan:blk:*")


async def _false(awaitable) -> bool:
    return not await awaitable


async def _true(value) -> bool:
    return bool(value)
