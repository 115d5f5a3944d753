"""The control plane declares a worker dead when its lease expires — at once, from
Redis's keyspace notification, without waiting for anyone to read the live set."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import grpc

from control_plane.lease_watch import LeaseWatcher
from kervan.block_hash import HASH_NAME
from kervan.kv_events import BlockStored
from services.kv_registry.index import PrefixIndex, WorkerRecord
from services.proto import kv_registry_pb2_grpc
from tests.services.conftest import start_registry


@asynccontextmanager
async def watching(index: PrefixIndex, redis_client, interval_s: float):
    """A kv-registry on ``index`` and a lease watcher over it, running."""
    registry = await start_registry(index)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{registry.port}")
    watcher = LeaseWatcher(redis_client, kv_registry_pb2_grpc.KvRegistryServiceStub(channel), interval_s=interval_s)
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
        token = await index.register(WorkerRecord(worker_id="w", address="127.0.0.1:1", role="decode", model="m",
                                                  incarnation="", block_size=16, hash_name=HASH_NAME,
                                                  max_model_len=4096, max_n=16))
        await index.apply("w", token, [BlockStored(1, [b"\x01" * 32, b"\x02" * 32], None, [], 16)])
        assert await redis_client.hlen("kervan:own:w") == 2
        for _ in range(100):  # the lease (1 s) expires; nobody heartbeats, nobody lists workers
            if not await redis_client.sismember("kervan:workers", "w"):
                break
            await asyncio.sleep(0.05)
        assert watcher.declared_dead == ["w"]
        assert not await redis_client.exists("kervan:own:w") and not await redis_client.keys("kervan:blk:*")


async def test_the_reconciliation_loop_purges_an_expired_worker_without_any_notification(redis_client):
    index = PrefixIndex(redis_client, ttl_s=1)
    async with watching(index, redis_client, interval_s=0.2) as watcher:
        for _ in range(100):  # the watcher subscribed; then Redis stops notifying (as after a restart)
            if await redis_client.execute_command("PUBSUB", "NUMPAT"):
                break
            await asyncio.sleep(0.05)
        await redis_client.config_set("notify-keyspace-events", "")
        token = await index.register(WorkerRecord(worker_id="w", address="127.0.0.1:1", role="decode", model="m",
                                                  incarnation="", block_size=16, hash_name=HASH_NAME,
                                                  max_model_len=4096, max_n=16))
        await index.apply("w", token, [BlockStored(1, [b"\x01" * 32], None, [], 16)])
        for _ in range(100):  # the lease (1 s) expires; only the loop can notice
            if not await redis_client.sismember("kervan:workers", "w"):
                break
            await asyncio.sleep(0.05)
        assert watcher.declared_dead == []  # no notification arrived
        assert not await redis_client.sismember("kervan:workers", "w")
        assert not await redis_client.exists("kervan:own:w") and not await redis_client.keys("kervan:blk:*")
