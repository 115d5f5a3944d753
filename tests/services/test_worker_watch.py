"""The scheduler's live set kept from the registry's ``WatchWorkers`` stream
(services/scheduler/live_view.py): joins, load changes and departures reach placement
without a listing; a registry without the call, or a stream gone silent, is listed instead."""

from __future__ import annotations

import asyncio

import grpc

from services.common.load import Load
from services.kv_registry.index import PrefixIndex
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc, scheduler_pb2
from services.scheduler.placement import PlacementConfig
from services.scheduler.servicer import SchedulerServicer
from tests.services.conftest import start_registry
from tests.services.test_kv_registry import record


class Context:
    def time_remaining(self):
        return 10.0


class Counting:
    """A registry stub that counts its listings."""

    def __init__(self, stub):
        self.stub = stub
        self.listings = 0

    def __getattr__(self, name):
        return getattr(self.stub, name)

    def ListWorkers(self, *args, **kwargs):
        self.listings += 1
        return self.stub.ListWorkers(*args, **kwargs)


async def placed_on(servicer: SchedulerServicer) -> str:
    request = scheduler_pb2.PlaceRequest(request_id="r", num_prompt_tokens=32, dry_run=True)
    return (await servicer.Place(request, Context())).decode_worker_id


async def until_placed_on(servicer: SchedulerServicer, worker_id: str) -> None:
    for _ in range(200):
        if await placed_on(servicer) == worker_id:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"placement never reached {worker_id}")


async def test_joins_loads_and_departures_reach_placement_without_a_listing(redis_client):
    index = PrefixIndex(redis_client, ttl_s=30)
    registry = await start_registry(index)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{registry.port}")
    stub = Counting(kv_registry_pb2_grpc.KvRegistryServiceStub(channel))
    servicer = SchedulerServicer(stub, PlacementConfig(), watch=True)
    try:
        a = await index.register(record("a"))
        await index.heartbeat("a", a, Load(num_free_blocks=100, num_blocks=100))
        assert await placed_on(servicer) == "a"
        b = await index.register(record("b"))
        await index.heartbeat("b", b, Load(num_free_blocks=100, num_blocks=100))
        await index.heartbeat("a", a, Load(num_free_blocks=20, num_blocks=100))  # a now busier than b
        await until_placed_on(servicer, "b")
        await index.deregister("b", b)
        await until_placed_on(servicer, "a")
        assert stub.listings == 0 and servicer.watch.streams == 1
    finally:
        servicer.watch.close()
        await channel.close()
        await registry.stop(0)


def worker(wid: str) -> kv_registry_pb2.LiveWorker:
    return kv_registry_pb2.LiveWorker(info=kv_registry_pb2.WorkerInfo(
        worker_id=wid, address=f"127.0.0.1:{ord(wid)}", role=kv_registry_pb2.WORKER_ROLE_BOTH, block_size=16,
        limits=kv_registry_pb2.RequestLimits(max_model_len=4096, max_n=4)))


class Registry:
    """A registry whose stream ``watch`` gives; its listing holds worker "l"."""

    def __init__(self, watch):
        self.WatchWorkers = watch
        self.listings = 0

    async def ListWorkers(self, request, timeout=None):
        self.listings += 1
        return kv_registry_pb2.ListWorkersResponse(workers=[worker("l")])

    async def Match(self, request, timeout=None):
        return kv_registry_pb2.MatchResponse()


async def test_a_registry_without_the_call_is_listed():
    async def unimplemented():
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "Method not found!")
        yield

    registry = Registry(lambda request: unimplemented())
    servicer = SchedulerServicer(registry, PlacementConfig(), watch=True)
    assert await placed_on(servicer) == "l" and registry.listings == 1 and servicer.watch.unsupported


async def test_a_stream_gone_silent_is_listed_instead():
    async def broken():  # a message the scheduler cannot apply (a record without a valid address)
        yield kv_registry_pb2.WatchWorkersResponse(reset=True, updated=[kv_registry_pb2.LiveWorker(
            info=kv_registry_pb2.WorkerInfo(worker_id="z"))], resync_s=1.0)

    registry = Registry(lambda request: broken())
    servicer = SchedulerServicer(registry, PlacementConfig(), watch=True)
    try:  # listed at once, not after waiting out the request's time for a first whole set
        started = asyncio.get_running_loop().time()
        assert await placed_on(servicer) == "l" and asyncio.get_running_loop().time() - started < 1.0
    finally:
        servicer.watch.close()

    async def silent():
        yield kv_registry_pb2.WatchWorkersResponse(reset=True, updated=[worker("w")], resync_s=0.02)
        await asyncio.sleep(3600)  # then nothing: not even the resyncs' empty messages

    registry = Registry(lambda request: silent())
    servicer = SchedulerServicer(registry, PlacementConfig(), watch=True)
    try:
        assert await placed_on(servicer) == "w" and registry.listings == 0
        await asyncio.sleep(0.15)  # past four resyncs
        assert await placed_on(servicer) == "l" and registry.listings == 1
    finally:
        servicer.watch.close()


async def test_a_view_without_a_new_worker_is_listed_again_before_a_request_is_refused():
    """A request moved twice excludes both workers it ran on; a view kept from before their
    replacement joined holds only those two. The scheduler lists afresh before it answers
    UNAVAILABLE (a chaos run once lost a request so)."""
    listings = [[worker("a"), worker("b")], [worker("a"), worker("b"), worker("c")]]

    class Joined(Registry):
        async def ListWorkers(self, request, timeout=None):
            self.listings += 1
            return kv_registry_pb2.ListWorkersResponse(workers=listings[min(self.listings, 2) - 1])
    registry = Joined(None)
    servicer = SchedulerServicer(registry, PlacementConfig(), workers_cache_s=30.0)  # the first listing is kept
    assert await placed_on(servicer) == "a"
    moved = scheduler_pb2.PlaceRequest(request_id="r", num_prompt_tokens=32, dry_run=True,
                                       exclude_addresses=[f"127.0.0.1:{ord('a')}", f"127.0.0.1:{ord('b')}"])
    assert (await servicer.Place(moved, Context())).decode_worker_id == "c" and registry.listings == 2


async def test_a_stream_that_ends_is_watched_again():
    opened = []

    async def ends():
        opened.append(1)
        yield kv_registry_pb2.WatchWorkersResponse(reset=True, updated=[worker("xy"[len(opened) - 1])], resync_s=1.0)
        if len(opened) == 1:
            await asyncio.sleep(0.2)  # then the first stream ends
        else:
            await asyncio.sleep(3600)

    registry = Registry(lambda request: ends())
    servicer = SchedulerServicer(registry, PlacementConfig(), watch=True)
    try:
        assert await placed_on(servicer) == "x"
        for _ in range(100):  # the registry ended the stream (a draining one does): the next one's whole set
            if servicer.watch.streams >= 2 and servicer.watch.view.reported[0].worker_id == "y":
                break
            await asyncio.sleep(0.02)
        assert await placed_on(servicer) == "y" and registry.listings == 0
    finally:
        servicer.watch.close()
