"""The KV index and membership, in Redis (soft state: workers re-send it all).

Keys (``kervan:`` prefix):

    workers               set of registered worker ids
    w:{id}                hash: the worker's record (address, role, model, incarnation,
                          block_size, hash_name, limits) and load fields; expires
                          unless heartbeats renew it
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

from kervan.kv_events import BlockRemoved, BlockStored, KVEvent
from services.common.errors import FailedPrecondition
from services.common.load import SCALARS, Load
from services.kv_registry import scripts
from services.kv_registry.block_owners import BlockOwners

log = logging.getLogger(__name__)
P = "kervan:"
LEASE_PREFIX = f"{P}w:"  # a worker's lease key is LEASE_PREFIX + its id (the lease watch listens for their expiry)


@dataclass(frozen=True, kw_only=True)
class WorkerRecord:
    worker_id: str
    address: str
    role: str
    model: str
    incarnation: str
    block_size: int
    hash_name: str
    max_model_len: int  # the longest request it serves (prompt + max_tokens)
    max_n: int  # the most samples per request it serves

    @classmethod
    def from_hash(cls, f: dict[str, str]) -> WorkerRecord:
        """The record a registration stored in the worker's Redis hash (every value a string)."""
        return cls(**{k.name: int(f[k.name]) if k.type == "int" else f[k.name] for k in fields(cls)})


class StaleIncarnation(FailedPrecondition):
    """A call from a worker process the registry no longer recognises: re-register."""

    def __init__(self, worker_id: str, incarnation: str):
        super().__init__(f"worker {worker_id!r} incarnation {incarnation!r} is not registered; re-register")


class PrefixIndex:
    def __init__(self, client: redis.Redis, ttl_s: int = 5):
        self.r = client
        self.ttl_s = ttl_s
        self.owners = BlockOwners(client, P)
        self._renew = client.register_script(scripts.RENEW)
        self._apply = client.register_script(scripts.APPLY)

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
        key = f"{LEASE_PREFIX}{worker.worker_id}"
        previous = await self.r.hget(key, "incarnation")
        if previous is not None and previous.decode() != worker.incarnation:
            await self.purge(worker.worker_id)  # a restarted process starts with an empty cache
        slot = await self.owners.allocate_slot(worker.worker_id)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.delete(key, f"{P}seq:{worker.worker_id}")
            pipe.hset(key, mapping={k: str(v) for k, v in {**asdict(worker), **{k: 0 for k in SCALARS},
                                                            "slot": slot}.items()})
            pipe.expire(key, self.ttl_s)
            pipe.sadd(f"{P}workers", worker.worker_id)
            pipe.srem(f"{P}unknown", worker.worker_id)  # a fresh process: known to be empty
            await pipe.execute()

    async def deregister(self, worker_id: str, incarnation: str) -> None:
        await self._check(worker_id, incarnation)
        await self.purge(worker_id)

    async def heartbeat(self, worker_id: str, incarnation: str, load: Load) -> bool:
        """Renew and record load; True when the registry needs the worker's full dump."""
        fields = [x for k in SCALARS for x in (k, str(getattr(load, k)))]
        answer = await self._renew(keys=[f"{LEASE_PREFIX}{worker_id}", f"{P}unknown"],
                                   args=[incarnation, worker_id, self.ttl_s, *fields])
        if answer < 0:
            raise StaleIncarnation(worker_id, incarnation)
        return bool(answer)

    async def apply(self, worker_id: str, incarnation: str, events: list[KVEvent]) -> tuple[int, bool]:
        """Apply events in sequence order, atomically and only for the registered
        incarnation; returns the last applied seq and whether the registry needs the
        worker's full dump (a gap now or before)."""
        ops: list = []
        for e in events:
            kind = "S" if isinstance(e, BlockStored) else "R" if isinstance(e, BlockRemoved) else "C"
            hexes = [h.hex() for h in getattr(e, "block_hashes", [])]
            ops += [kind, e.seq, getattr(e, "medium", ""), len(hexes), *hexes]
        last, unknown, gap = await self._write(worker_id, incarnation, ops)
        if gap:
            log.warning("worker %s: KV events missing (batch %d..%d); asking for a full dump", worker_id,
                        events[0].seq, events[-1].seq)
        return last, unknown

    async def replace_blocks(self, worker_id: str, incarnation: str, seq: int, tiers: dict[str, list[bytes]]) -> int:
        """A full dump, as of event ``seq``: becomes all the registry knows of the worker."""
        ops: list = ["C", seq, "", 0]
        for tier, hashes in tiers.items():
            ops += ["S", seq, tier, len(hashes), *(h.hex() for h in hashes)]
        await self._write(worker_id, incarnation, ops, replace=True)
        return len({h for hashes in tiers.values() for h in hashes})

    async def _write(self, worker_id: str, incarnation: str, ops: list, replace: bool = False
                     ) -> tuple[int, bool, bool]:
        answer = await self._apply(keys=[f"{LEASE_PREFIX}{worker_id}", f"{P}own:{worker_id}", f"{P}seq:{worker_id}",
                                         f"{P}unknown"],
                                   args=[incarnation, worker_id, self.owners.block_prefix, "1" if replace else "0",
                                         *ops])
        if answer == -1:
            raise StaleIncarnation(worker_id, incarnation)
        return int(answer[0]), bool(answer[1]), bool(answer[2])

    async def live_workers(self) -> list[tuple[WorkerRecord, Load]]:
        """Registered workers whose registration has not expired; expired ones are purged."""
        ids = sorted(w.decode() for w in await self.r.smembers(f"{P}workers"))
        async with self.r.pipeline(transaction=False) as pipe:
            for wid in ids:
                pipe.hgetall(f"{LEASE_PREFIX}{wid}")
            records = await pipe.execute()
        live = []
        for wid, record in zip(ids, records):
            if not record:
                await self.purge(wid)
                continue
            f = {k.decode(): v.decode() for k, v in record.items()}
            worker = WorkerRecord.from_hash(f)
            live.append((worker, Load(**{k: int(f.get(k, 0)) for k in SCALARS})))
        return live

    async def purge(self, worker_id: str) -> None:
        await self._drop_ownership(worker_id)
        await self.r.delete(f"{LEASE_PREFIX}{worker_id}", f"{P}seq:{worker_id}")
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

    async def _check(self, worker_id: str, incarnation: str) -> None:
        """Raises StaleIncarnation unless ``incarnation`` is the registered one."""
        current = await self.r.hget(f"{LEASE_PREFIX}{worker_id}", "incarnation")
        if current is None or current.decode() != incarnation:
            raise StaleIncarnation(worker_id, incarnation)
