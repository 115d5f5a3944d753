"""The KV index on a real Redis: ownership, prefix matches, liveness, fencing."""

import asyncio

import pytest

from kervan.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kervan.sampling import InvalidRequest, RequestLimits
from kervan.worker_info import WorkerInfo, WorkerRole
from services.common.errors import AlreadyExists
from services.common.load import Load
from services.kv_registry.index import PrefixIndex, StaleIncarnation
from services.kv_registry.scripts import MAX_SEQ_JUMP


def Stored(hashes, seq):
    return BlockStored(seq, hashes, None, [], 16)


def Removed(hashes, seq):
    return BlockRemoved(seq, hashes)

H = [bytes([i]) * 32 for i in range(6)]


def record(wid):
    return WorkerInfo(worker_id=wid, address=f"127.0.0.1:{1000 + len(wid)}", role=WorkerRole.DECODE, model="m",
                      block_size=16, hash_name="sha256", limits=RequestLimits(max_model_len=4096, max_n=16))


async def test_prefix_match_counts_leading_blocks_per_worker(redis_client):
    index = PrefixIndex(redis_client)
    a = await index.register(record("a"))
    b = await index.register(record("b"))
    assert (await index.apply("a", a, [Stored(H[:4], 1)]))[0] == 1
    await index.apply("b", b, [Stored(H[:2], 1), Stored([H[3]], 2)])  # b lacks H[2]
    assert (await index.match(H[:5]))[0] == {"a": 4, "b": 2}
    assert (await index.match([H[5]] + H[:3]))[0] == {}
    await index.apply("a", a, [Removed([H[1]], 2)])
    assert (await index.match(H[:5]))[0] == {"a": 1, "b": 2}
    # a retried batch is idempotent
    assert (await index.apply("a", a, [Removed([H[1]], 2), AllBlocksCleared(3)]))[0] == 3
    assert (await index.match(H[:5]))[0] == {"b": 2}


async def test_stale_incarnation_is_fenced_and_a_new_registration_starts_empty(redis_client):
    index = PrefixIndex(redis_client, ttl_s=1)
    old = await index.register(record("a"))
    await index.apply("a", old, [Stored(H[:3], 1)])
    with pytest.raises(AlreadyExists):  # a second live process under the id is refused, not swapped in
        await index.register(record("a"))
    assert (await index.match(H[:3]))[0] == {"a": 3}
    await redis_client.delete("kervan:w:a")  # the lease ran out (not yet purged)
    new = await index.register(record("a"))  # the process restarted: its cache is gone
    assert new != old and int(new.split(".")[0]) > int(old.split(".")[0])  # fencing tokens only grow
    assert (await index.match(H[:3]))[0] == {}
    with pytest.raises(StaleIncarnation):
        await index.apply("a", old, [Stored(H[:3], 2)])
    with pytest.raises(StaleIncarnation):
        await index.heartbeat("a", old, Load())
    with pytest.raises(StaleIncarnation):
        await index.heartbeat("never-registered", "x", Load())
    with pytest.raises(StaleIncarnation):
        await index.deregister("a", old)  # a zombie cannot take its successor down
    assert [r.worker_id for r, _ in await index.live_workers()] == ["a"]


async def test_a_purge_of_what_a_reader_saw_spares_a_worker_that_re_registered_since(redis_client):
    """A purge saw a's lease expired; before it ran, a registered again. The
    purge (one script, conditioned on what was seen) leaves the new registration whole:
    the five separate awaits it replaced freed the new registration's slot."""
    index = PrefixIndex(redis_client)
    await index.register(record("a"))
    await redis_client.delete("kervan:w:a")  # seen expired by a reader
    token = await index.register(record("a"))
    await index.apply("a", token, [Stored(H[:2], 1)])
    assert not await index.purge("a")  # the reader's purge, late: nothing to do
    assert not await index.purge("a", "1.0")  # nor for a token that is not the current one
    assert (await index.match(H[:2]))[0] == {"a": 2}
    assert await redis_client.hget("kervan:slots", "a") == b"0"
    b = await index.register(record("b"))
    assert await redis_client.hget("kervan:slots", "b") == b"1"  # a's slot is not handed out twice
    assert await index.heartbeat("b", b, Load()) is False


async def test_expired_worker_is_dead_and_purged(redis_client):
    index = PrefixIndex(redis_client, ttl_s=1)
    a = await index.register(record("a"))
    b = await index.register(record("b"))
    await index.apply("a", a, [Stored(H[:2], 1)])
    await index.heartbeat("b", b, Load(num_running=3, num_blocks=10))
    live = await index.live_workers()
    assert [(r.worker_id, load.num_running) for r, load in live] == [("a", 0), ("b", 3)]
    for _ in range(100):  # a's lease runs out (nobody renews it); b's is renewed before each look
        await index.heartbeat("b", b, Load(num_running=1))
        live = [r.worker_id for r, _ in await index.live_workers()]
        if live == ["b"]:
            break
        await asyncio.sleep(0.05)
    assert live == ["b"]
    assert (await index.match(H[:2]))[0] == {"a": 2}  # listing only reads: a is left out, not purged
    assert await index.purge_expired() == ["a"]
    assert (await index.match(H[:2]))[0] == {}
    assert await redis_client.exists("kervan:own:a") == 0
    assert await index.purge_expired() == []  # b's lease is live


async def test_the_registry_keeps_a_loads_counts_and_the_wire_carries_the_expert_balance(redis_client):
    from services.common.convert import load_from_proto, load_to_proto
    load = Load(num_running=2, num_blocks=10, num_aborted=1, expert_tokens_per_rank=(30, 12))
    assert load_from_proto(load_to_proto(load)) == load  # GetLoad carries the MoE balance per rank
    index = PrefixIndex(redis_client)
    a = await index.register(record("a"))
    await index.heartbeat("a", a, load)
    [(_, kept)] = await index.live_workers()  # the registry keeps the counts placement reads, not the balance
    assert kept == Load(num_running=2, num_blocks=10, num_aborted=1)


async def test_a_gap_makes_the_worker_unknown_until_its_dump_replaces_its_blocks(redis_client):
    index = PrefixIndex(redis_client)
    a = await index.register(record("a"))
    b = await index.register(record("b"))
    assert await index.apply("a", a, [Stored(H[:3], 1)]) == (1, False)
    assert await index.apply("a", a, [Removed([H[0]], 3)]) == (3, True)  # event 2 was lost
    # unknown, not empty: the last known blocks still answer, flagged
    assert await index.match(H[:3]) == ({}, ["a"])
    assert await index.heartbeat("a", a, Load()) and not await index.heartbeat("b", b, Load())
    assert await index.replace_blocks("a", a, 5, {"device": H[:2], "host": [H[4]]}) == 3
    assert await index.match(H[:3]) == ({"a": 2}, [])
    assert await redis_client.hgetall("kervan:own:a") == {H[0].hex().encode(): b"device",
                                                         H[1].hex().encode(): b"device", H[4].hex().encode(): b"host"}
    assert await index.apply("a", a, [Stored([H[2]], 6)]) == (6, False)
    assert await index.match(H[:4]) == ({"a": 3}, [])
    # a registry that starts over vouches for nothing until the dumps arrive
    await index.forget_all()
    assert await index.match(H[:1]) == ({"a": 1}, ["a", "b"])
    with pytest.raises(StaleIncarnation):
        await index.replace_blocks("a", "old", 7, {})


async def test_a_seq_far_past_the_last_is_refused_and_the_workers_own_events_still_apply(redis_client):
    """A forged event at seq 10^9 (with a stolen token) was accepted, and the worker's own later
    events, at lower seqs, were then skipped."""
    index = PrefixIndex(redis_client)
    a = await index.register(record("a"))
    assert await index.apply("a", a, [Stored(H[:1], 1)]) == (1, False)
    with pytest.raises(InvalidRequest, match="jump more than"):
        await index.apply("a", a, [Stored(H[1:2], 10**9)])
    assert await index.apply("a", a, [Stored(H[1:3], 2)]) == (2, False)  # nothing of the forged call applied
    assert await index.match(H[:3]) == ({"a": 3}, [])
    assert (await index.apply("a", a, [Stored([H[3]], 2 + MAX_SEQ_JUMP)]))[0] == 2 + MAX_SEQ_JUMP  # a gap within
    b = await index.register(record("b"))  # a new registration: its process's seq is wherever it is
    assert (await index.apply("b", b, [Stored(H[:1], 10**9)]))[0] == 10**9


def test_leading_owners_walks_slot_bitmaps_as_redis_numbers_bits():
    from services.kv_registry.block_owners import leading_owners
    # slot 0 is the first byte's most significant bit; slot 9 is in the second byte
    a, b, j = 0x80, 0x40, 0x0040
    bitmaps = [bytes([a | b]) + bytes([j]), bytes([a | b, j]), bytes([a]), None, bytes([a])]
    assert leading_owners(bitmaps, {0: "a", 1: "b", 9: "j"}) == {"a": 3, "b": 2, "j": 2}
    assert leading_owners([bytes([a])], {0: "a"}) == {"a": 1}
    assert leading_owners([None, bytes([a])], {0: "a"}) == {}


async def test_empty_bitmaps_are_deleted_and_slots_reused(redis_client):
    index = PrefixIndex(redis_client)
    a = await index.register(record("a"))
    b = await index.register(record("b"))
    await index.apply("b", b, [Stored(H[:2], 1)])
    await index.apply("b", b, [Removed(H[:2], 2)])
    assert await redis_client.keys("kervan:blk:*") == []
    assert await index.purge("a", a)
    await index.register(record("c"))  # takes the slot a left
    assert await redis_client.hgetall("kervan:slots") == {b"b": b"1", b"c": b"0"}


async def test_redis_coming_back_empty_keeps_the_last_workers_listed_until_they_re_register(redis_client):
    from services.kv_registry.servicer import KvRegistryServicer
    from services.proto import kv_registry_pb2

    registry = KvRegistryServicer(PrefixIndex(redis_client, ttl_s=2), 16, "sha256")

    async def listed():
        response = await registry.ListWorkers(kv_registry_pb2.ListWorkersRequest(), None)
        return [w.info.worker_id for w in response.workers]

    tokens = {wid: await registry.index.register(record(wid)) for wid in ("a", "b", "c")}
    assert await listed() == ["a", "b", "c"]
    await registry.index.deregister("c", tokens["c"])  # a worker leaving is gone at once
    assert await listed() == ["a", "b"]
    await redis_client.flushall()  # within the generation check's interval: the shrink itself triggers a check
    assert await listed() == ["a", "b"] and registry.generations.started == 1
    await registry.index.register(record("b"))
    response = await registry.ListWorkers(kv_registry_pb2.ListWorkersRequest(), None)
    assert [w.info.worker_id for w in response.workers] == ["b", "a"]
    assert {w.info.incarnation for w in response.workers} == {""}  # fencing tokens are never listed


async def test_a_match_says_how_many_of_a_workers_blocks_are_in_its_host_tier(redis_client):
    index = PrefixIndex(redis_client)
    a = await index.register(record("a"))
    b = await index.register(record("b"))
    await index.apply("a", a, [Stored(H[:4], 1)])
    await index.apply("b", b, [Stored(H[:3], 1)])
    assert await index.match_tiers(H[:4]) == ({"a": 4, "b": 3}, [], {}, {})  # nobody keeps a second tier yet
    # a's pool reused the first two blocks; its host tier keeps them
    await index.apply("a", a, [Removed(H[:2], 2), BlockStored(3, H[:2], None, [], 16, "host")])
    assert await index.match_tiers(H[:4]) == ({"a": 4, "b": 3}, [], {"a": 2}, {})
    # then the host tier let the first go on to disk
    await index.apply("a", a, [BlockStored(4, H[:1], None, [], 16, "disk")])
    assert await index.match_tiers(H[:4]) == ({"a": 4, "b": 3}, [], {"a": 1}, {"a": 1})
    assert await redis_client.smembers("kervan:tiered") == {b"a"}
    assert await index.purge("a", a)
    assert await redis_client.smembers("kervan:tiered") == set()  # the set holds live workers only
