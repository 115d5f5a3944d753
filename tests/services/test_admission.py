"""Admission control: past its limit a worker refuses new requests at once with
RESOURCE_EXHAUSTED and a RetryInfo (before doing any work for them), and the
requests it took still finish; the scheduler places nothing on a worker that
reports itself at its limit, and refuses when every worker does; the router
places a request a worker refused on another one."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kervan.sampling import RequestLimits, SamplingParams
from kervan.worker_info import WorkerInfo, WorkerRole
from services.common.errors import Overloaded, retry_after_s
from services.common.load import Load
from services.common.server import Service, start_server
from services.kv_registry.index import PrefixIndex
from services.proto import common_pb2, kv_registry_pb2_grpc, router_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from services.router.routes import Placement
from services.router.runner import MigrationPolicy, RequestRunner
from services.scheduler.__main__ import SERVICE_NAME as SCHEDULER_NAME
from services.scheduler.placement import PlacementConfig
from services.scheduler.servicer import SchedulerServicer
from tests.conftest import greedy_tokens, make_engine, make_prompts
from tests.services.conftest import start_mesh, start_registry, start_worker


async def test_overload_is_refused_fast_with_retry_info_and_accepted_requests_finish(llama):
    mesh, stop = await start_mesh(llama[1], max_waiting=2, max_num_seqs=2)
    try:
        prompts = make_prompts([12] * 16, seed=60)

        async def one(prompt):
            tokens = 0
            try:
                async for msg in mesh.router.Generate(router_pb2.GenerateRequest(
                        token_ids=common_pb2.TokenIds(ids=prompt),
                        sampling=common_pb2.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)),
                        timeout=60):
                    tokens += len(msg.delta.token_ids)
                return "ok", tokens
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                assert "limit" in err.details() and retry_after_s(err) == 0.5
                return "refused", 0

        results = await asyncio.gather(*(one(p) for p in prompts))  # 4 times what the worker admits
        ok = [r for r in results if r[0] == "ok"]
        refused = [r for r in results if r[0] == "refused"]
        assert len(ok) >= 4 and len(refused) >= 8
        assert all(tokens == 200 for _, tokens in ok)
        for _ in range(100):
            load = mesh.workers[0].engine.load()
            if load.num_free_blocks == load.num_blocks and not load.num_running:
                break
            await asyncio.sleep(0.05)
        assert load.num_free_blocks == load.num_blocks and not load.num_running
    finally:
        await stop()


async def test_the_scheduler_skips_full_workers_and_refuses_when_all_are_full(redis_client):
    index = PrefixIndex(redis_client)
    registry = await start_registry(index)
    to_registry = grpc.aio.insecure_channel(f"127.0.0.1:{registry.port}")
    # every placement lists the workers afresh: each report below is seen by the next placement
    servicer = SchedulerServicer(kv_registry_pb2_grpc.KvRegistryServiceStub(to_registry), PlacementConfig(),
                                 workers_cache_s=0.0)
    scheduler = await start_server([Service(SCHEDULER_NAME, lambda s: (
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, s)))])
    to_scheduler = grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}")
    stub = scheduler_pb2_grpc.SchedulerServiceStub(to_scheduler)
    try:
        tokens = {wid: await index.register(WorkerInfo(
            worker_id=wid, address=f"127.0.0.1:{ord(wid)}", role=WorkerRole.BOTH, model="m", block_size=16,
            hash_name="sha256", limits=RequestLimits(max_model_len=4096, max_n=16))) for wid in ("a", "b")}

        async def report(wid, requests):
            await index.heartbeat(wid, tokens[wid], Load(num_free_blocks=100, num_blocks=100, num_requests=requests,
                                                  max_requests=4))

        def place(rid):
            return stub.Place(scheduler_pb2.PlaceRequest(request_id=rid, num_prompt_tokens=8), timeout=10)

        await report("a", 4)
        await report("b", 3)
        assert (await place("r1")).decode_worker_id == "b"  # both idle, a (first by id) at its limit
        await report("b", 4)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await place("r2")
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "request limit" in refused.value.details() and retry_after_s(refused.value) == 0.5
        await report("a", 3)
        assert (await place("r3")).decode_worker_id == "a"
        stats = await stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
        assert (stats.placements, stats.refused) == (2, 1)
    finally:
        await to_scheduler.close()
        await to_registry.close()
        await scheduler.stop(0)
        await registry.stop(0)


async def test_a_placement_past_the_window_takes_the_last_listing_while_a_new_one_runs():
    """A large mesh's listing takes tens of ms: a placement just past ``workers_cache_s``
    does not wait for it (within twice a listing's time), and the next one sees the new set."""
    from services.proto import kv_registry_pb2

    def worker(wid: str, port: int):
        return kv_registry_pb2.LiveWorker(info=kv_registry_pb2.WorkerInfo(
            worker_id=wid, address=f"127.0.0.1:{port}", role=kv_registry_pb2.WORKER_ROLE_BOTH, model="m",
            limits=kv_registry_pb2.RequestLimits(max_model_len=4096, max_n=4)))
    listings = [[worker("a", 7)], [worker("b", 8)]]
    calls = []

    class SlowRegistry:
        async def ListWorkers(self, request, timeout=None):
            calls.append(time.monotonic())
            await asyncio.sleep(0.2)
            return kv_registry_pb2.ListWorkersResponse(workers=listings[min(len(calls), 2) - 1])

        async def Match(self, request, timeout=None):
            return kv_registry_pb2.MatchResponse()

    from prometheus_client import REGISTRY

    def decisions() -> float:  # the scheduler's kervan_placement_decision_seconds, one per placement
        return REGISTRY.get_sample_value("kervan_placement_decision_seconds_count") or 0.0
    timed_before = decisions()
    servicer = SchedulerServicer(SlowRegistry(), PlacementConfig(), workers_cache_s=0.05)
    request = scheduler_pb2.PlaceRequest(request_id="r", num_prompt_tokens=8)
    assert (await servicer.Place(request, _Context())).decode_worker_id == "a"  # waited for the first listing
    await asyncio.sleep(0.1)  # past the window, within it plus twice the 0.2 s listing
    started = time.monotonic()
    assert (await servicer.Place(request, _Context())).decode_worker_id == "a"  # the old set, at once
    assert time.monotonic() - started < 0.15 and len(calls) == 2  # while the new listing runs
    await asyncio.sleep(0.25)
    assert (await servicer.Place(request, _Context())).decode_worker_id == "b"  # the new set
    assert decisions() - timed_before == 3  # each placement's own work timed, without the registry's


class FirstNotExcluded:
    """The scheduler reduced to "the first worker not excluded" (the real one is tested above)."""

    alternatives = True

    def __init__(self, workers):
        self.workers = workers

    async def route(self, request_id, prompt, max_tokens, n, timeout, model="", exclude=(), avoid=(), cache_salt=""):
        for address, stub in self.workers:
            if address not in exclude:
                return Placement(worker=stub, worker_address=address)
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "no healthy decode or aggregated worker is registered")


class NoDeadline:
    def remaining(self):
        return None


async def test_a_request_a_worker_refuses_goes_to_another_and_is_refused_when_none_has_room(llama):
    (a, stop_a), (b, stop_b) = [await start_worker(llama[1], "both", max_waiting=0, max_num_seqs=1) for _ in "ab"]
    runner = RequestRunner(FirstNotExcluded([("a", a.stub), ("b", b.stub)]), "", MigrationPolicy())
    prompts = make_prompts([12, 13, 14], seed=61)
    expected = greedy_tokens(llama[1], prompts, 8)
    holds = []
    try:
        async def hold(worker, rid):  # occupy the worker's only slot for a while (490 tokens)
            call = worker.stub.Execute(worker_pb2.ExecuteRequest(
                request_id=rid, prompt=common_pb2.TokenIds(ids=prompts[0]),
                sampling=common_pb2.SamplingParams(max_tokens=490, temperature=0.0, ignore_eos=True)))
            holds.append(call)
            await call.read()  # its first token: admitted

        async def run(k):
            tokens = []
            async for _, update in runner.run(f"r{k}", prompts[k], SamplingParams(
                    max_tokens=8, temperature=0.0, ignore_eos=True), NoDeadline()):
                tokens += update.token_ids
            return tokens

        await hold(a, "hold-a")
        assert await run(1) == expected[1]  # a refused it (its slot is taken): b ran it
        await hold(b, "hold-b")
        with pytest.raises(Overloaded, match="limit") as refused:
            await run(2)
        assert refused.value.retry_after_s == 0.5
        assert a.engine.load().num_requests == b.engine.load().num_requests == 1  # only the holds ran
    finally:
        for call in holds:
            call.cancel()
        await stop_a()
        await stop_b()


async def test_suspects_are_avoided_within_the_ejection_cap_and_all_of_them_is_panic(redis_client):
    """Four idle workers. The router's suspects are avoided, but at most half of them
    (the most recent first), and when avoiding would leave fewer than half, none: before,
    one slow period that marked every worker suspect made every placement fail."""
    index = PrefixIndex(redis_client)
    registry = await start_registry(index)
    to_registry = grpc.aio.insecure_channel(f"127.0.0.1:{registry.port}")
    servicer = SchedulerServicer(kv_registry_pb2_grpc.KvRegistryServiceStub(to_registry),
                                 PlacementConfig(temperature=1.0), seed=0)  # ties drawn at random: all show
    addresses = [f"127.0.0.1:{100 + k}" for k in range(4)]
    try:
        for k, address in enumerate(addresses):
            token = await index.register(WorkerInfo(
                worker_id=f"w{k}", address=address, role=WorkerRole.BOTH, model="m", block_size=16,
                hash_name="sha256", limits=RequestLimits(max_model_len=4096, max_n=16)))
            await index.heartbeat(f"w{k}", token, Load(num_free_blocks=100, num_blocks=100))

        async def placed(avoid, exclude=()):
            request = scheduler_pb2.PlaceRequest(request_id="r", num_prompt_tokens=8, dry_run=True,
                                                 avoid_addresses=avoid, exclude_addresses=exclude)
            return {(await servicer.Place(request, _Context())).decode_address for _ in range(40)}

        assert await placed(addresses[:1]) == set(addresses[1:])
        assert await placed(addresses[1:]) == {addresses[0], addresses[3]}  # 2 of 4 at most: the most recent
        assert await placed(addresses) == set(addresses[2:])
        assert await placed(addresses[1:], exclude=addresses[:1]) == set(addresses[2:])  # 1 of the 3 left
        # one left and suspect: avoiding it would leave nothing, so it is not avoided
        assert await placed(addresses[3:], exclude=addresses[:3]) == {addresses[3]}
    finally:
        await to_registry.close()
        await registry.stop(0)


async def test_the_ejection_cap_counts_each_role_apart(redis_client):
    """One decode worker beside three prefill workers, the decode worker suspect: half of
    the whole pool would allow avoiding it, and every placement would then find no decode
    worker; counted per role, the only decode worker stays. Prefill suspects are avoided
    within their own role's half."""
    index = PrefixIndex(redis_client)
    registry = await start_registry(index)
    to_registry = grpc.aio.insecure_channel(f"127.0.0.1:{registry.port}")
    servicer = SchedulerServicer(kv_registry_pb2_grpc.KvRegistryServiceStub(to_registry),
                                 PlacementConfig(temperature=1.0), seed=0)
    roles = {"127.0.0.1:200": WorkerRole.DECODE, **{f"127.0.0.1:{201 + k}": WorkerRole.PREFILL for k in range(4)}}
    try:
        for k, (address, role) in enumerate(roles.items()):
            token = await index.register(WorkerInfo(
                worker_id=f"w{k}", address=address, role=role, model="m", block_size=16,
                hash_name="sha256", limits=RequestLimits(max_model_len=4096, max_n=16)))
            await index.heartbeat(f"w{k}", token, Load(num_free_blocks=100, num_blocks=100))

        async def placed(avoid):
            hashes = [bytes([k]) * 32 for k in range(64)]
            request = scheduler_pb2.PlaceRequest(request_id="r", num_prompt_tokens=1024, dry_run=True,
                                                 avoid_addresses=avoid, block_hashes=hashes)
            replies = [await servicer.Place(request, _Context()) for _ in range(40)]
            return {r.decode_address for r in replies}, {r.prefill_address for r in replies}
        decode, prefill = await placed(["127.0.0.1:200", "127.0.0.1:201", "127.0.0.1:202", "127.0.0.1:203"])
        assert decode == {"127.0.0.1:200"}
        assert prefill <= {"127.0.0.1:203", "127.0.0.1:204", ""} and "127.0.0.1:204" in prefill  # 2 of 4 avoided
    finally:
        await to_registry.close()
        await registry.stop(0)


class _Context:
    def time_remaining(self):
        return 10.0


async def test_admission_counts_a_requests_samples_not_the_request(llama):
    """max_num_seqs 3 + max_waiting 1 is 4 sequences: a request of n = 3 and one of n = 2
    do not both fit (before, they counted as 2 requests of 4)."""
    from services.worker.async_engine import AsyncEngine
    engine = AsyncEngine(make_engine(llama[1], max_num_seqs=3), max_waiting=1)  # not started: nothing finishes
    params = SamplingParams(max_tokens=4, temperature=1.0, n=3, ignore_eos=True)
    first = engine.generate("a", [5, 6, 7], params)
    task = asyncio.create_task(anext(first))
    await asyncio.sleep(0.01)
    assert engine.load().num_requests == 3
    with pytest.raises(Overloaded, match="3 sequences in flight and this request adds 2"):
        await anext(engine.generate("b", [5, 6], SamplingParams(max_tokens=4, temperature=1.0, n=2)))
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await first.aclose()


async def test_a_registry_that_does_not_answer_in_time_is_taken_for_a_down_one():
    """A slow registry (its Redis slow) times out after ``registry_timeout_s``: the scheduler
    places on the last live set it saw, as for an unreachable one (before, only UNAVAILABLE
    fell back, and a placement waited out the client's whole deadline)."""
    from services.proto import kv_registry_pb2

    worker = kv_registry_pb2.LiveWorker(info=kv_registry_pb2.WorkerInfo(
        worker_id="w", address="127.0.0.1:7", role=kv_registry_pb2.WORKER_ROLE_BOTH, model="m",
        limits=kv_registry_pb2.RequestLimits(max_model_len=4096, max_n=4)))
    calls = []

    class SlowRegistry:
        async def ListWorkers(self, request, timeout=None):
            calls.append(timeout)
            if len(calls) > 1:
                raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), "Deadline Exceeded")
            return kv_registry_pb2.ListWorkersResponse(workers=[worker])

        async def Match(self, request, timeout=None):
            return kv_registry_pb2.MatchResponse()

    servicer = SchedulerServicer(SlowRegistry(), PlacementConfig(), workers_cache_s=0.0)  # each lists afresh
    request = scheduler_pb2.PlaceRequest(request_id="r", num_prompt_tokens=8)
    for _ in range(2):  # the second placement: the registry timed out
        assert (await servicer.Place(request, _Context())).decode_address == "127.0.0.1:7"
    assert calls == [servicer.registry_timeout_s] * 2  # waited 2 s, not the client's 10


async def test_concurrent_placements_share_one_listing_of_the_workers_and_reuse_a_fresh_one():
    """ListWorkers costs a Redis read per worker: placements in flight together wait for one
    listing, and those within ``workers_cache_s`` of it reuse it."""
    from services.proto import kv_registry_pb2

    worker = kv_registry_pb2.LiveWorker(info=kv_registry_pb2.WorkerInfo(
        worker_id="w", address="127.0.0.1:7", role=kv_registry_pb2.WORKER_ROLE_BOTH, model="m",
        limits=kv_registry_pb2.RequestLimits(max_model_len=4096, max_n=4)))
    calls = []

    class Registry:
        async def ListWorkers(self, request, timeout=None):
            calls.append(timeout)
            await asyncio.sleep(0.05)
            return kv_registry_pb2.ListWorkersResponse(workers=[worker])

        async def Match(self, request, timeout=None):
            return kv_registry_pb2.MatchResponse()

    servicer = SchedulerServicer(Registry(), PlacementConfig(), workers_cache_s=30.0)
    request = scheduler_pb2.PlaceRequest(request_id="r", num_prompt_tokens=8)
    answers = await asyncio.gather(*(servicer.Place(request, _Context()) for _ in range(8)))
    assert {a.decode_address for a in answers} == {"127.0.0.1:7"} and len(calls) == 1
    await servicer.Place(request, _Context())
    assert len(calls) == 1  # within the window: the same listing
    servicer.workers_cache_s = 0.0
    await servicer.Place(request, _Context())
    assert len(calls) == 2

