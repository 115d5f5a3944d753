"""The one pool of channels to workers (services/common/channels.py): bounded, least
recently used first out, an evicted channel's calls given their grace, a departed peer's
channel closed at once. Against a real gRPC server on loopback."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.channels import ChannelPool

METHOD = "/kervan.test.Echo/Slow"
NOWHERE = "127.0.0.1:1"  # nothing listens: a channel there is never used to call


@pytest.fixture
async def slow_server():
    """A server whose one method answers its request after 0.3 s."""
    async def slow(request: bytes, context) -> bytes:
        await asyncio.sleep(0.3)
        return request
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("kervan.test.Echo", {
        "Slow": grpc.unary_unary_rpc_method_handler(slow)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(None)


def echo_pool(**kwargs) -> ChannelPool:
    return ChannelPool(lambda channel: channel.unary_unary(METHOD), role=None, **kwargs)


async def closed(call_stub) -> bool:
    try:
        await call_stub(b"x", timeout=0.5)
    except grpc.aio.UsageError:
        return True
    except grpc.aio.AioRpcError:
        return False
    return False


async def test_past_its_bound_the_least_recently_used_channel_closes():
    pool = echo_pool(max_channels=2)
    a, b = pool.stub("127.0.0.1:11"), pool.stub("127.0.0.1:12")
    assert pool.stub("127.0.0.1:11") is a  # one channel per address; and a is now the most recent
    pool.stub("127.0.0.1:13")
    assert pool.addresses() == ["127.0.0.1:11", "127.0.0.1:13"] and len(pool) == 2
    await asyncio.sleep(0.05)
    assert await closed(b) and not await closed(a)
    await pool.close()
    assert len(pool) == 0 and await closed(a)


async def test_an_evicted_channel_lets_its_calls_finish_within_the_grace(slow_server):
    pool = echo_pool(max_channels=1, close_grace_s=5.0)
    call = asyncio.ensure_future(pool.stub(slow_server)(b"kept", timeout=5))
    await asyncio.sleep(0.05)
    pool.stub(NOWHERE)  # evicts the server's channel while its call runs
    assert await call == b"kept"
    assert await pool.stub(slow_server)(b"again", timeout=5) == b"again"  # a fresh channel on next use
    await pool.close()


async def test_without_a_grace_an_evicted_channel_cancels_its_calls(slow_server):
    pool = echo_pool(max_channels=1)
    call = asyncio.ensure_future(pool.stub(slow_server)(b"lost", timeout=5))
    await asyncio.sleep(0.05)
    pool.stub(NOWHERE)
    with pytest.raises(asyncio.CancelledError):  # how grpc.aio ends a call its own channel cancelled
        await call
    await pool.close()


async def test_a_peer_that_left_is_discarded_at_once(slow_server):
    pool = echo_pool()
    stub = pool.stub(slow_server)
    assert await stub(b"hi", timeout=5) == b"hi"
    await pool.discard(slow_server)
    await pool.discard("127.0.0.1:14")  # never opened: nothing to do
    assert pool.addresses() == [] and await closed(stub)
    with pytest.raises(ValueError, match="max_channels"):
        echo_pool(max_channels=0)
