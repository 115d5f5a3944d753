"""The standard health service of every Kervan server: NOT_SERVING until the service
says it is ready, NOT_SERVING again from the first moment of a drain (before it leaves
the mesh), while the calls in flight run to their end."""

from __future__ import annotations

import asyncio
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.server import Service, serve_until_signal, start_server
from services.proto import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker.__main__ import SERVICE_NAME as WORKER_NAME
from services.worker.async_engine import AsyncEngine
from services.worker.servicer import WorkerServicer
from tests.conftest import make_engine, make_prompts

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def test_not_serving_before_ready_and_from_the_start_of_a_drain_that_finishes_calls(llama):
    engine = AsyncEngine(make_engine(llama[1]))
    engine.start()
    servicer = WorkerServicer(engine)
    handle = await start_server([Service(WORKER_NAME, lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(
        servicer, s))])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    health = health_pb2_grpc.HealthStub(channel)
    release = threading.Event()
    try:
        for name in ("", WORKER_NAME):  # up, but not ready
            assert (await health.Check(health_pb2.HealthCheckRequest(service=name))).status == NOT_SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(service=WORKER_NAME))
        assert (await watch.read()).status == NOT_SERVING
        stop = asyncio.Event()
        during_drain = []

        async def on_drain():  # leaving the mesh: health already says NOT_SERVING
            during_drain.append((await health.Check(health_pb2.HealthCheckRequest(service=""))).status)

        serving = asyncio.create_task(serve_until_signal(handle, stop=stop, grace=30, on_drain=on_drain))
        assert (await watch.read()).status == SERVING
        call = worker_pb2_grpc.WorkerServiceStub(channel).Execute(worker_pb2.ExecuteRequest(
            request_id="long", prompt=common_pb2.TokenIds(ids=make_prompts([12], seed=140)[0]),
            sampling=common_pb2.SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)))
        tokens = len((await call.read()).update.token_ids)
        engine.post(lambda e: release.wait(30))  # the request cannot finish before the drain starts
        stop.set()
        assert (await watch.read()).status == NOT_SERVING
        watch.cancel()
        release.set()
        while (msg := await call.read()) is not grpc.aio.EOF:  # drained: the request runs to its end
            tokens += len(msg.update.token_ids)
        assert tokens == 300 and during_drain == [NOT_SERVING]
        await serving
    finally:
        release.set()
        await channel.close()
        await handle.stop(0)
        await servicer.close()
        engine.stop()
