"""A worker's membership against a real kv-registry on a real Redis: its blocks
reach the index, and a registry that loses track of them (a gap in the events, a
restart) gets them back from a full dump."""

import asyncio
import logging

import grpc
import pytest

from kervan.block_hash import HASH_NAME
from services.kv_registry.index import PrefixIndex
from services.proto import kv_registry_pb2_grpc
from services.worker.async_engine import AsyncEngine
from services.worker.membership import Membership
from tests.conftest import make_engine, make_prompts
from tests.services.conftest import start_registry
from worker import SamplingParams


async def until(predicate, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        if await predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_blocks_reach_the_index_and_gaps_and_restarts_are_healed_by_dumps(llama, redis_client, caplog):
    index = PrefixIndex(redis_client)
    registry = await start_registry(index, block_size=4)
    engine = AsyncEngine(make_engine(llama[1]))
    engine.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{registry.port}")
    member = Membership(kv_registry_pb2_grpc.KvRegistryServiceStub(channel), engine, "127.0.0.1:1", "both", "m",
                        heartbeat_s=0.1)
    task = asyncio.create_task(member.run())
    wid = member.info.worker_id
    params = SamplingParams(max_tokens=1, temperature=0)
    try:
        async def run(rid, prompt):
            async for _ in engine.generate(rid, prompt, params):
                pass

        async def index_has(n):  # the worker's blocks, all of them, none unknown
            cached = await engine.call(lambda e: list(e.kv.pool.cached))
            matched, unknown = await index.match(cached[:1])
            owned = await redis_client.hkeys(f"kervan:own:{wid}")
            return not unknown and len(cached) == n and sorted(owned) == sorted(h.hex().encode() for h in cached)

        await until(lambda: index.live_workers())
        [(record, _)] = await index.live_workers()  # registered with the engine's own limits
        assert record.limits == engine.limits and engine.limits.max_model_len and engine.limits.max_n
        await run("r1", make_prompts([12], seed=40)[0])  # 3 full blocks of 4 tokens
        await until(lambda: index_has(3))
        hashes = await engine.call(lambda e: list(e.kv.pool.cached))
        # an event is lost (its number skipped) and with it what the index knew
        await engine.call(lambda e: setattr(e.kv.pool, "_seq", e.kv.pool._seq + 1))
        await redis_client.delete(f"kervan:own:{wid}")
        await run("r2", make_prompts([8], seed=41)[0])
        await until(lambda: index_has(5))  # the gap was seen, and the dump restored all of it
        # the registry restarts: it vouches for nothing until the dump
        await index.forget_all()
        assert (await index.match(hashes[:1]))[1] == [wid]
        await until(lambda: index_has(5))
        # Redis restarts empty: the heartbeat and the event loop both learn they are stale;
        # one registers again, the other finds it done (it once registered a second time, was
        # refused as a live duplicate of itself, and waited out its own new lease)
        stale = member.info.incarnation
        with caplog.at_level(logging.WARNING, logger="services.worker.membership"):
            await redis_client.flushall()
            await run("r3", make_prompts([8], seed=42)[0])  # an event to publish, from the other loop
            await until(lambda: index_has(7), timeout=3.0)  # well within the 5 s lease
        assert member.info.incarnation != stale and "held by a live process" not in caplog.text
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await channel.close()
        await registry.stop(0)
        engine.stop()


async def test_a_worker_hashing_differently_is_refused_at_registration(redis_client):
    from services.proto import kv_registry_pb2
    registry = await start_registry(PrefixIndex(redis_client))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{registry.port}") as channel:
            stub = kv_registry_pb2_grpc.KvRegistryServiceStub(channel)
            limits = kv_registry_pb2.RequestLimits(max_model_len=640, max_n=4)
            info = dict(worker_id="w", address="127.0.0.1:1", role=kv_registry_pb2.WORKER_ROLE_DECODE, model="m",
                        incarnation="i", limits=limits)
            for block_size, hash_name in ((8, HASH_NAME), (16, "xxhash64")):
                try:
                    await stub.Register(kv_registry_pb2.RegisterRequest(worker=kv_registry_pb2.WorkerInfo(
                        **info, block_size=block_size, hash_name=hash_name)))
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
                    assert f"{block_size} tokens with {hash_name!r}" in err.details()
                    assert f"16 tokens with {HASH_NAME!r}" in err.details()
                else:
                    raise AssertionError("registered a worker that hashes blocks differently")
            for missing, without in (("max_model_len", {"limits": kv_registry_pb2.RequestLimits(max_n=4)}),
                                     ("max_n", {"limits": kv_registry_pb2.RequestLimits(max_model_len=640)}),
                                     ("role", {"role": kv_registry_pb2.WORKER_ROLE_UNSPECIFIED}),
                                     ("role", {"role": 7})):  # the scheduler places by them: required
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Register(kv_registry_pb2.RegisterRequest(worker=kv_registry_pb2.WorkerInfo(
                        **{**info, **without}, block_size=16, hash_name=HASH_NAME)))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and missing in refused.value.details()
            for name, forged in (("worker_id", "decode@evil\nINFO forged"), ("address", "127.0.0.1:1\r"),
                                 ("model", "m\x1b[31m")):  # log injection: refused, never registered
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Register(kv_registry_pb2.RegisterRequest(worker=kv_registry_pb2.WorkerInfo(
                        **{**info, name: forged}, block_size=16, hash_name=HASH_NAME)))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in refused.value.details()
            assert not await redis_client.scard("kervan:workers")
            await stub.Register(kv_registry_pb2.RegisterRequest(worker=kv_registry_pb2.WorkerInfo(
                **info, block_size=16, hash_name=HASH_NAME)))
            assert await redis_client.sismember("kervan:workers", "w")
            listed = (await stub.ListWorkers(kv_registry_pb2.ListWorkersRequest())).workers
            assert [(w.info.role, w.info.limits) for w in listed] == [(kv_registry_pb2.WORKER_ROLE_DECODE, limits)]
    finally:
        await registry.stop(0)


async def test_both_loops_finding_the_registration_stale_register_again_once():
    """The heartbeat and the event loop learn at the same moment that the registry lost the
    worker (Redis restarted empty). One registers again; the other sees the new token and
    does not: a second registration would be refused as a live duplicate of the first, and
    before, the worker then waited out its own new lease, unregistered."""
    from services.proto import kv_registry_pb2
    registrations = []

    class Registry:
        async def Register(self, request, timeout=None):
            registrations.append(request.worker.worker_id)
            await asyncio.sleep(0.05)
            return kv_registry_pb2.RegisterResponse(ttl_s=5, incarnation=f"{len(registrations)}.n")

    class Engine:
        block_size, limits = 4, type("Limits", (), {"max_model_len": 64, "max_n": 1})()

        def stats(self):
            return type("Stats", (), {"num_blocks": 16})()

    member = Membership(Registry(), Engine(), "127.0.0.1:1", "both", "m")
    await member.register()
    gone = asyncio.Event()

    async def stale_call():
        await gone.wait()  # both calls were sent before either answer came back
        raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "incarnation is not registered; re-register")

    calls = [asyncio.create_task(member._guarded(stale_call)) for _ in range(2)]
    await asyncio.sleep(0.01)
    gone.set()
    assert await asyncio.gather(*calls) == [False, False]
    assert len(registrations) == 2 and member.info.incarnation == "2.n"  # the start, and one again


async def test_a_full_dump_sends_the_host_tiers_blocks_as_host(llama, redis_client):
    """A registry that forgot the worker gets back, from its dump, the pool's blocks as the
    device's and the blocks only its host tier holds as the host's."""
    index = PrefixIndex(redis_client)
    registry = await start_registry(index, block_size=4)
    engine = AsyncEngine(make_engine(llama[1], num_kv_blocks=12, kv_host_bytes=64 << 10))
    engine.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{registry.port}")
    member = Membership(kv_registry_pb2_grpc.KvRegistryServiceStub(channel), engine, "127.0.0.1:1", "both", "m",
                        heartbeat_s=0.1)
    task = asyncio.create_task(member.run())
    wid = member.info.worker_id
    params = SamplingParams(max_tokens=1, temperature=0)
    try:
        await until(lambda: index.live_workers())
        for k, prompt in enumerate(make_prompts([40, 40], seed=43)):  # the second pushes the first to host memory
            async for _ in engine.generate(f"r{k}", prompt, params):
                pass
        host_only = set(await engine.call(lambda e: e.tier_blocks()["host"]))
        assert host_only
        await redis_client.delete(f"kervan:own:{wid}")
        await index.forget_all()  # as after a registry restart: the next heartbeat asks for the dump

        async def dumped():
            tiers = {bytes.fromhex(k.decode()): v.decode()
                     for k, v in (await redis_client.hgetall(f"kervan:own:{wid}")).items()}
            return tiers and {h for h, t in tiers.items() if t == "host"} == host_only
        await until(dumped)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await channel.close()
        await registry.stop(0)
        engine.stop()
