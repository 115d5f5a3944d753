"""The error interceptor: the domain's own exceptions name a client mistake; anything
else, a ValueError from deep inside included, is INTERNAL (and logged, with the
request id), never INVALID_ARGUMENT."""

from __future__ import annotations

import logging

import grpc
import pytest

from services.common.errors import Overloaded, retry_after_s
from services.common.server import Service, start_server
from services.proto import worker_pb2, worker_pb2_grpc
from worker import InvalidRequest


class Raising(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, exc: Exception):
        self.exc = exc

    async def Abort(self, request, context):
        raise self.exc


@pytest.mark.parametrize("exc, code, words", [
    (InvalidRequest("max_tokens must be >= 1"), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1"),
    (Overloaded("queue full", 2.0), grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"),
    (ValueError("asked for 9 blocks, 2 free"), grpc.StatusCode.INTERNAL, "internal error: ValueError"),
    (KeyError("x"), grpc.StatusCode.INTERNAL, "internal error: KeyError"),
])
async def test_only_domain_errors_are_the_clients_fault(exc, code, words, caplog):
    server = await start_server([Service("kervan.v1.WorkerService", lambda s: (
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(Raising(exc), s)))])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            with caplog.at_level(logging.ERROR), pytest.raises(grpc.aio.AioRpcError) as err:
                await worker_pb2_grpc.WorkerServiceStub(ch).Abort(worker_pb2.AbortRequest(request_id="r-17"))
    finally:
        await server.stop(0)
    assert err.value.code() == code and words in err.value.details()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        assert retry_after_s(err.value) == 2.0
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert bool(logged) == (code == grpc.StatusCode.INTERNAL)  # only Kervan's own faults are logged as errors
    assert all("r-17" in r.getMessage() for r in logged)
