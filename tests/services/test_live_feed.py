"""The registry's ``WatchWorkers`` feed on a real Redis: the whole live set first, then each
registration, load change and departure as it happens; expired leases by the resync; a
watcher that falls behind gets the whole set again. And the slot-table cache of matches."""

import asyncio

import grpc
import pytest

from services.common.errors import Overloaded
from services.common.load import Load
from services.kv_registry.generation import Generations
from services.kv_registry.index import PrefixIndex
from services.kv_registry.live_feed import LiveFeed
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc
from tests.services.conftest import start_registry
from tests.services.test_kv_registry import H, Stored, record


def feed_of(index: PrefixIndex, **kw) -> LiveFeed:
    return LiveFeed(index, Generations(index.r, index.owners.generation_key, grace_s=0.0), **kw)


async def next_change(stream, timeout: float = 5.0) -> kv_registry_pb2.WatchWorkersResponse:
    """The next message that changes something (the resyncs' empty ones skipped)."""
    async def first():
        async for message in stream:
            if message.reset or message.updated or message.removed:
                return message
    return await asyncio.wait_for(first(), timeout)


def ids(message) -> list[str]:
    return [w.info.worker_id for w in message.updated]


async def test_a_watcher_sees_the_whole_set_then_each_change(redis_client):
    index = PrefixIndex(redis_client, ttl_s=30)
    a = await index.register(record("a"))
    feed = feed_of(index, resync_s=0.2)
    stream = feed.watch()
    first = await next_change(stream)
    assert first.reset and ids(first) == ["a"] and first.resync_s == 0.2

    b = await index.register(record("b"))
    change = await next_change(stream)
    assert not change.reset and ids(change) == ["b"] and not change.removed

    await index.heartbeat("b", b, Load(num_running=3, num_blocks=64, num_free_blocks=60))
    change = await next_change(stream)
    assert ids(change) == ["b"] and change.updated[0].load.num_running == 3

    await index.heartbeat("b", b, Load(num_running=3, num_blocks=64, num_free_blocks=60))  # the same load again
    await index.deregister("a", a)
    change = await next_change(stream)
    assert list(change.removed) == ["a"] and not change.updated  # the unchanged renewal sent nothing

    await redis_client.delete("kervan:w:b")  # b's lease ran out: nothing is published, the resync sees it
    change = await next_change(stream)
    assert list(change.removed) == ["b"]
    feed.close()
    assert [m async for m in stream] == []  # the stream ends


async def test_an_empty_message_comes_every_resync(redis_client):
    feed = feed_of(PrefixIndex(redis_client), resync_s=0.05)
    stream = feed.watch()
    messages = [await asyncio.wait_for(anext(stream), 5) for _ in range(4)]
    assert messages[0].reset and all(not (m.reset or m.updated or m.removed) for m in messages[1:])
    feed.close()


async def test_a_watcher_that_falls_behind_gets_the_whole_set(redis_client):
    index = PrefixIndex(redis_client, ttl_s=30)
    feed = feed_of(index, resync_s=10.0, flush_s=0.0, queue_size=2)
    slow = feed.watch()
    assert (await anext(slow)).reset
    for name in "abcde":  # five changes, each flushed alone, into a queue of two
        await index.register(record(name))
        await asyncio.sleep(0.05)
    message = await asyncio.wait_for(anext(slow), 5)
    assert message.reset and ids(message) == list("abcde")
    feed.close()


async def test_the_feed_follows_redis_only_while_watched(redis_client):
    index = PrefixIndex(redis_client, ttl_s=30)
    await index.register(record("a"))
    feed = feed_of(index, resync_s=0.05)
    one, two = feed.watch(), feed.watch()
    assert ids(await anext(one)) == ["a"] and ids(await anext(two)) == ["a"]
    following = feed._task
    await one.aclose()
    assert feed._task is following and not following.done()  # one watcher is left
    await two.aclose()
    assert feed._task is None
    await asyncio.wait([following], timeout=5)
    assert following.cancelled()  # no resync for nobody
    await index.register(record("b"))
    again = feed.watch()
    first = await next_change(again)
    assert first.reset and ids(first) == ["a", "b"]  # read afresh
    feed.close()


async def test_watchers_are_bounded(redis_client):
    feed = feed_of(PrefixIndex(redis_client), max_watchers=1)
    first = feed.watch()
    await anext(first)
    with pytest.raises(Overloaded):
        await anext(feed.watch())
    feed.close()


async def test_watch_workers_over_grpc(redis_client):
    index = PrefixIndex(redis_client, ttl_s=30)
    await index.register(record("a"))
    server = await start_registry(index)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = kv_registry_pb2_grpc.KvRegistryServiceStub(channel).WatchWorkers(
                kv_registry_pb2.WatchWorkersRequest())
            first = await next_change(call)
            assert first.reset and ids(first) == ["a"] and first.updated[0].info.address
            await index.register(record("b"))
            assert ids(await next_change(call)) == ["b"]
            call.cancel()
    finally:
        await server.stop(0)


async def test_matches_reread_the_slot_table_only_when_it_changed(redis_client):
    """Under a generation, a match reads the table once per version: a purge, a new
    registration taking the freed slot and a clear each change what matches answer."""
    index = PrefixIndex(redis_client, ttl_s=30)
    await Generations(redis_client, index.owners.generation_key, grace_s=0.0).check()
    a = await index.register(record("a"))
    await index.apply("a", a, [Stored(H[:3], 1)])
    assert (await index.match(H[:3]))[0] == {"a": 3}
    cached = index.owners._slots
    assert (await index.match(H[:2]))[0] == {"a": 2} and index.owners._slots is cached  # not read again
    await index.deregister("a", a)
    assert (await index.match(H[:3]))[0] == {}
    c = await index.register(record("c"))  # the lowest free slot, once a's is swept
    await index.apply("c", c, [Stored(H[:1], 1)])
    assert (await index.match(H[:3]))[0] == {"c": 1}
    await redis_client.delete(index.owners.generation_key)  # Redis came back empty: versions count again
    assert (await index.match(H[:3]))[0] == {"c": 1}


async def test_a_redis_that_came_back_empty_keeps_the_workers_until_they_register_again(redis_client):
    """As ListWorkers does: for the generation's grace the workers not back yet are not sent as
    gone (they still serve); one that registers again is sent at once."""
    index = PrefixIndex(redis_client, ttl_s=30)
    generations = Generations(redis_client, index.owners.generation_key, grace_s=30.0)
    await index.register(record("a"))
    await index.register(record("b"))
    feed = LiveFeed(index, generations, resync_s=0.05)
    stream = feed.watch()
    assert ids(await next_change(stream)) == ["a", "b"]
    await redis_client.flushdb()  # Redis restarted empty: a new generation
    await index.register(record("b"))
    change = await next_change(stream)
    assert ids(change) == ["b"] and not change.removed
    await asyncio.sleep(0.3)  # resyncs meanwhile: a is not sent as gone
    assert generations.rebuilding and "a" in feed._workers
    feed.close()
