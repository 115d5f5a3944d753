"""The whole mesh in one process, on loopback: a real kv-registry on the real Redis,
the real scheduler, workers that join through their real ``Membership``, and a router
placing through the scheduler. Cheaper than processes (a worker starts in under a
second), so failover can be exercised one promise at a time: ``kill`` stops a worker's
server and its heartbeats at once, as a crashed process would (its lease lives on)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kervan.block_hash import HASH_NAME
from services.common.server import Server, Service, start_server
from services.kv_registry.__main__ import SERVICE_NAME as REGISTRY_NAME
from services.kv_registry.index import PrefixIndex
from services.kv_registry.servicer import KvRegistryServicer
from services.proto import kv_registry_pb2_grpc, router_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, worker_pb2_grpc
from services.router.__main__ import SERVICE_NAME as ROUTER_NAME
from services.router.__main__ import model_limits
from services.router.routes import Channels, ScheduledRoutes, worker_channels
from services.router.runner import MigrationPolicy
from services.router.servicer import RouterServicer
from services.scheduler.__main__ import SERVICE_NAME as SCHEDULER_NAME
from services.scheduler.placement import PlacementConfig
from services.scheduler.servicer import SchedulerServicer
from services.worker.__main__ import SERVICE_NAME as WORKER_NAME
from services.worker.async_engine import AsyncEngine
from services.worker.membership import Membership
from services.worker.servicer import WorkerServicer
from tests.conftest import make_engine

BLOCK_SIZE = 16


@dataclass
class MeshWorker:
    name: str
    address: str
    engine: AsyncEngine
    server: Server
    servicer: WorkerServicer
    membership: asyncio.Task
    alive: bool = True


@dataclass
class ScheduledMesh:
    model_dir: Path
    redis: object  # redis.asyncio.Redis, flushed by the fixture
    registry: Server = None
    registry_stub: kv_registry_pb2_grpc.KvRegistryServiceStub = None
    scheduler: Server = None
    scheduler_stub: scheduler_pb2_grpc.SchedulerServiceStub = None
    router_server: Server = None
    router_servicer: RouterServicer = None
    router: router_pb2_grpc.RouterServiceStub = None
    workers: list[MeshWorker] = field(default_factory=list)
    _channels: list[grpc.aio.Channel] = field(default_factory=list)
    _routes: Channels = field(default_factory=worker_channels)

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = grpc.aio.insecure_channel(address)
        self._channels.append(ch)
        return ch

    async def start(self, num_workers: int, policy: MigrationPolicy, max_in_flight: int = 1024) -> None:
        index = PrefixIndex(self.redis, ttl_s=5)
        self.registry = await start_server([Service(REGISTRY_NAME, lambda s: (
            kv_registry_pb2_grpc.add_KvRegistryServiceServicer_to_server(
                KvRegistryServicer(index, BLOCK_SIZE, HASH_NAME), s)))])
        self.registry_stub = kv_registry_pb2_grpc.KvRegistryServiceStub(
            self.channel(f"127.0.0.1:{self.registry.port}"))
        self.scheduler = await start_server([Service(SCHEDULER_NAME, lambda s: (
            scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(
                SchedulerServicer(self.registry_stub, PlacementConfig()), s)))])
        self.scheduler_stub = scheduler_pb2_grpc.SchedulerServiceStub(self.channel(f"127.0.0.1:{self.scheduler.port}"))
        for _ in range(num_workers):
            await self.add_worker()
        self.router_servicer = RouterServicer(
            ScheduledRoutes(self.scheduler_stub, self._routes), None, model_limits(self.model_dir),
            max_in_flight=max_in_flight, migration=policy)
        self.router_server = await start_server([Service(ROUTER_NAME, lambda s: (
            router_pb2_grpc.add_RouterServiceServicer_to_server(self.router_servicer, s)))])
        await self.router_server.set_serving(True)
        self.router = router_pb2_grpc.RouterServiceStub(self.channel(f"127.0.0.1:{self.router_server.port}"))

    async def add_worker(self, **engine_options) -> MeshWorker:
        engine = AsyncEngine(make_engine(self.model_dir, **{"block_size": BLOCK_SIZE, "num_kv_blocks": 256,
                                                            **engine_options}))
        engine.start()
        servicer = WorkerServicer(engine, "both")
        server = await start_server([Service(WORKER_NAME, lambda s: (
            worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, s)))])
        await server.set_serving(True)
        address = f"127.0.0.1:{server.port}"
        member = Membership(self.registry_stub, engine, address, "both", self.model_dir.name, heartbeat_s=0.2)
        await member.register()
        worker = MeshWorker(f"w{len(self.workers)}", address, engine, server, servicer,
                            asyncio.get_running_loop().create_task(member.run()))
        self.workers.append(worker)
        return worker

    def live(self) -> list[MeshWorker]:
        return [w for w in self.workers if w.alive]

    def busy(self) -> MeshWorker:
        """The live worker running a request (the one streaming to the test's client)."""
        [worker] = [w for w in self.live() if w.engine.load().num_requests]
        return worker

    async def kill(self, worker: MeshWorker) -> None:
        """As a crash: connections reset, no heartbeat, no deregistration."""
        worker.alive = False
        worker.membership.cancel()
        await asyncio.gather(worker.membership, return_exceptions=True)
        await worker.server.server.stop(0)
        await worker.servicer.close()
        worker.engine.stop()

    async def placements(self) -> int:
        return (await self.scheduler_stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)).placements

    async def stop(self) -> None:
        for ch in self._channels:
            await ch.close()
        await self._routes.close()
        if self.router_server is not None:
            await self.router_server.stop(0)
        for w in self.live():
            await self.kill(w)
        for server in (self.scheduler, self.registry):
            if server is not None:
                await server.stop(0)


def address(mesh: ScheduledMesh) -> str:
    """The mesh's router."""
    return f"127.0.0.1:{mesh.router_server.port}"
