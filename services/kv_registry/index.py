"""The KV index and membership, in Redis (soft state: workers re-send it all).

Keys (``kervan:`` prefix):

    workers               set of registered worker ids
    w:{id}                hash: address, role, model, incarnation, block_size,
                          hash_name, load fields; expires unless heartbeats renew it
    seq:{id}              last applied event sequence number of the worker
    slots                 hash: worker id -> its slot in the block bitmaps
    blk:{hash hex}        bitmap of the slots of the workers holding that block
                          (``block_owners.py``)
    own:{id}              hash: block hash (hex) -> tier, what the worker holds
    unknown               set of worker ids whose block sets the registry cannot
                          vouch for (a gap in their events, or the registry
                          restarted) until a full dump replaces them

A worker whose ``w:{id}`` key expired is dead: its ownership is purged the next
time the live set is read. A worker the registry cannot account for is
"unknown", never "empty": its last known blocks still answer matches, flagged,
and its next heartbeat or publish is told to send a full dump. A block lives in
one tier per worker at a time (a move is sent as removal, then store). Updates go
in pipelines; a prefix match is one round trip."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields

import redis.asyncio as redis

from services.common.errors import FailedPrecondition
from services.common.load import Load
from services.kv_registry.block_owners import BlockOwners
from worker.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)
P = "kervan:"


@dataclass(frozen=True)
class WorkerRecord:
    worker_id: str
    address: str
    role: str
    model: str
    incarnation: str
    block_size: int
    hash_name: str


# Renew a lease only for the incarnation that holds it, in one step: an expired or
# re-registered key is never recreated or extended by a late heartbeat. KEYS: w:{id},
# unknown; ARGV: incarnation, worker id, ttl, then load field/value pairs. Returns -1
# (stale), else whether the registry wants the worker's full dump.
_RENEW = """
if redis.call('HGET', KEYS[1], 'incarnation') ~= ARGV[1] then return -1 end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], ARGV[3])
return redis.call('SISMEMBER', KEYS[2], ARGV[2])
"""


class StaleIncarnation(FailedPrecondition):
    """A call from a worker process the registry no longer recognises: re-register."""


class PrefixIndex:
    def __init__(self, client: redis.Redis, ttl_s: int = 5):
        self.r = client
        self.ttl_s = ttl_s
        self.owners = BlockOwners(client, P)
        self._renew = client.register_script(_RENEW)

    async def match(self, block_hashes: list[bytes]) -> tuple[dict[str, int], list[str]]:
        """Worker id -> how many leading blocks of the prompt it holds, and the workers
        whose block sets are unknown (their counts are the last known state)."""
        return await self.owners.match(block_hashes, f"{P}unknown")

    async def forget_all(self) -> None:
        """On registry start: nothing in Redis is vouched for until each worker's dump."""
        workers = await self.r.smembers(f"{P}workers")
        if workers:
            await self.r.sadd(f"{P}unknown", *workers)

    async def register(self, worker: WorkerRecord) -> None:
        key = f"{P}w:{worker.worker_id}"
        previous = await self.r.hget(key, "incarnation")
        if previous is not None and previous.decode() != worker.incarnation:
            await self.purge(worker.worker_id)  # a restarted process starts with an empty cache
        slot = await self.owners.allocate_slot(worker.worker_id)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.delete(key, f"{P}seq:{worker.worker_id}")
            pipe.hset(key, mapping={k: str(v) for k, v in {**asdict(worker), **asdict(Load()), "slot": slot}.items()})
            pipe.expire(key, self.ttl_s)
            pipe.sadd(f"{P}workers", worker.worker_id)
            pipe.srem(f"{P}unknown", worker.worker_id)  # a fresh process: known to be empty
            await pipe.execute()

    async def deregister(self, worker_id: str, incarnation: str) -> None:
        await self._check(worker_id, incarnation)
        await self.purge(worker_id)

    async def heartbeat(self, worker_id: str, incarnation: str, load: Load) -> bool:
        """Renew and record load; True when the registry needs the worker's full dump."""
        fields = [x for k, v in asdict(load).items() for x in (k, str(v))]
        answer = await self._renew(keys=[f"{P}w:{worker_id}", f"{P}unknown"],
                                   args=[incarnation, worker_id, self.ttl_s, *fields])
        if answer < 0:
            raise StaleIncarnation(f"worker {worker_id!r} incarnation {incarnation!r} is not registered; re-register")
        return bool(answer)

    async def apply(self, worker_id: str, incarnation: str, events: list[KVEvent]) -> tuple[int, bool]:
        """Apply events in sequence order; returns the last applied seq and whether
        the registry needs the worker's full dump (a gap now or before)."""
        slot = await self._check(worker_id, incarnation)
        last = int(await self.r.get(f"{P}seq:{worker_id}") or 0)
        own = f"{P}own:{worker_id}"
        gap = False
        async with self.r.pipeline(transaction=False) as pipe:
            for event in events:
                seq = event.seq
                if seq <= last:
                    continue  # a retry of an applied batch: idempotent
                if seq != last + 1:
                    log.warning("worker %s: KV events %d..%d missing; asking for a full dump", worker_id, last + 1,
                                seq - 1)
                    gap = True
                last = seq
                hexes = [h.hex() for h in getattr(event, "block_hashes", [])]
                if isinstance(event, BlockStored) and hexes:
                    self.owners.add(pipe, slot, hexes)
                    pipe.hset(own, mapping={h: event.medium for h in hexes})
                elif isinstance(event, BlockRemoved) and hexes:
                    await self.owners.remove(pipe, slot, hexes)
                    pipe.hdel(own, *hexes)
                elif isinstance(event, AllBlocksCleared):
                    await pipe.execute()
                    await self._drop_ownership(worker_id)
            pipe.set(f"{P}seq:{worker_id}", last)
            if gap:
                pipe.sadd(f"{P}unknown", worker_id)
            pipe.sismember(f"{P}unknown", worker_id)
            *_, unknown = await pipe.execute()
        return last, bool(unknown)

    async def replace_blocks(self, worker_id: str, incarnation: str, seq: int, tiers: dict[str, list[bytes]]) -> int:
        """A full dump, as of event ``seq``: becomes all the registry knows of the worker."""
        slot = await self._check(worker_id, incarnation)
        await self._drop_ownership(worker_id)
        owned = {h.hex(): tier for tier, hashes in tiers.items() for h in hashes}
        async with self.r.pipeline(transaction=True) as pipe:
            self.owners.add(pipe, slot, list(owned))
            if owned:
                pipe.hset(f"{P}own:{worker_id}", mapping=owned)
            pipe.set(f"{P}seq:{worker_id}", seq)
            pipe.srem(f"{P}unknown", worker_id)
            await pipe.execute()
        return len(owned)

    async def live_workers(self) -> list[tuple[WorkerRecord, Load]]:
        """Registered workers whose registration has not expired; expired ones are purged."""
        ids = sorted(w.decode() for w in await self.r.smembers(f"{P}workers"))
        async with self.r.pipeline(transaction=False) as pipe:
            for wid in ids:
                pipe.hgetall(f"{P}w:{wid}")
            records = await pipe.execute()
        live = []
        for wid, record in zip(ids, records):
            if not record:
                await self.purge(wid)
                continue
            f = {k.decode(): v.decode() for k, v in record.items()}
            live.append((WorkerRecord(f["worker_id"], f["address"], f["role"], f["model"], f["incarnation"],
                                      int(f["block_size"]), f["hash_name"]),
                         Load(**{k.name: int(f.get(k.name, 0)) for k in fields(Load)})))
        return live

    async def purge(self, worker_id: str) -> None:
        await self._drop_ownership(worker_id)
        await self.r.delete(f"{P}w:{worker_id}", f"{P}seq:{worker_id}")
        await self.r.srem(f"{P}workers", worker_id)
        await self.r.srem(f"{P}unknown", worker_id)
        await self.owners.release_slot(worker_id)

    async def _drop_ownership(self, worker_id: str) -> None:
        own = f"{P}own:{worker_id}"
        slot = await self.r.hget(self.owners.slots_key, worker_id)
        hashes = [h.decode() for h in await self.r.hkeys(own)]
        async with self.r.pipeline(transaction=False) as pipe:
            if slot is not None and hashes:
                await self.owners.remove(pipe, int(slot), hashes)
            pipe.delete(own)
            await pipe.execute()

    async def _check(self, worker_id: str, incarnation: str) -> int:
        """The worker's slot, if ``incarnation`` is the registered one."""
        current, slot = await self.r.hmget(f"{P}w:{worker_id}", ["incarnation", "slot"])
        if current is None or current.decode() != incarnation:
            raise StaleIncarnation(f"worker {worker_id!r} incarnation {incarnation!r} is not registered; re-register")
        return int(slot)
