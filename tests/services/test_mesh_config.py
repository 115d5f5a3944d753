"""One block size and hash function per mesh, set on the kv-registry: the router asks
for it through the scheduler instead of assuming its own (a router hashing 16-token
blocks in a mesh of 8 had every prefix lookup miss, silently), and refuses a mesh that
hashes with another function. Real registry, Redis, scheduler and gRPC, on loopback."""

import socket

import grpc
import pytest

from services.common.errors import FailedPrecondition
from services.common.server import Service, start_server
from services.kv_registry.index import PrefixIndex
from services.proto import kv_registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.router.routes import ScheduledRoutes, worker_channels
from services.scheduler.__main__ import SERVICE_NAME as SCHEDULER_NAME
from services.scheduler.placement import PlacementConfig
from services.scheduler.servicer import SchedulerServicer
from tests.services.conftest import start_registry


async def _scheduler_over(registry_address: str):
    """A real scheduler server over the registry at ``registry_address``: its stub, and a stop."""
    registry_channel = grpc.aio.insecure_channel(registry_address)
    servicer = SchedulerServicer(kv_registry_pb2_grpc.KvRegistryServiceStub(registry_channel), PlacementConfig())
    scheduler = await start_server([Service(SCHEDULER_NAME, lambda s: (
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, s)))])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}")

    async def stop():
        await channel.close()
        await registry_channel.close()
        await scheduler.stop(0)
    return scheduler_pb2_grpc.SchedulerServiceStub(channel), stop


async def _routes_over(redis_client, **registry):
    registry_server = await start_registry(PrefixIndex(redis_client, ttl_s=5), **registry)
    stub, stop_scheduler = await _scheduler_over(f"127.0.0.1:{registry_server.port}")

    async def stop():
        await stop_scheduler()
        await registry_server.stop(0)
    return ScheduledRoutes(stub, worker_channels()), stub, stop


async def test_the_router_hashes_with_the_block_size_the_registry_answers(redis_client):
    routes, scheduler, stop = await _routes_over(redis_client, block_size=8)
    try:
        answer = await scheduler.GetMeshConfig(scheduler_pb2.SchedulerServiceGetMeshConfigRequest(), timeout=5)
        assert (answer.config.block_size, answer.config.hash_name) == (8, "sha256")
        assert routes.block_size is None  # asked on first need: the router may start before the mesh
        assert await routes.mesh_block_size(5) == 8
    finally:
        await stop()


async def test_a_mesh_hashing_with_another_function_is_refused_by_the_router(redis_client):
    routes, _, stop = await _routes_over(redis_client, hash_name="xxhash64")
    try:
        with pytest.raises(FailedPrecondition, match="xxhash64"):
            await routes.route("r", list(range(40)), max_tokens=4, n=1, timeout=5)
    finally:
        await stop()


async def test_the_scheduler_answers_unavailable_while_the_registry_is_down():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    scheduler, stop = await _scheduler_over(dead)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await scheduler.GetMeshConfig(
                scheduler_pb2.SchedulerServiceGetMeshConfigRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "kv-registry" in err.value.details()
    finally:
        await stop()
