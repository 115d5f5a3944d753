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
    fence                 counter of fencing tokens: each registration's incarnation

A worker whose ``w:{id}`` key expired is dead: its ownership is purged the next
time the live set is read. A worker the registry cannot account for is
"unknown", never "empty": its last known blocks still answer matches, flagged,
and its next heartbeat or publish is told to send a full dump. A block lives in
one tier per worker at a time (a move is sent as removal, then store). Updates go
in pipelines; a prefix match is one round trip. Registration and purges are each
one Lua script (``scripts.py``), so no purge can interleave with a registration."""

from __future__ import annotations

import logging
import secrets
from dataclasses import asdict, dataclass, fields

import redis.asyncio as redis

from kervan.kv_events import BlockRemoved, BlockStored, KVEvent
from services.common.errors import AlreadyExists, FailedPrecondition
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
        self._register = client.register_script(scripts.REGISTER)
        self._purge = client.register_script(scripts.PURGE)
        self._live = client.register_script(scripts.LIVE)

    async def match(self, block_hashes: list[bytes]) -> tuple[dict[str, int], list[str]]:
        """Worker id -> how many leading blocks of the prompt it holds, and the workers
        whose block sets are unknown (their counts are the last known state)."""
        return await self.owners.match(block_hashes, f"{P}unknown")

    async def forget_all(self) -> None:
        """On registry start: nothing in Redis is vouched for until each worker's dump."""
        workers = await self.r.smembers(f"{P}workers")
        if workers:
            await self.r.sadd(f"{P}unknown", *workers)

    async def register(self, worker: WorkerRecord) -> str:
        """Registers a worker under a new fencing token (its incarnation), returned;
        refuses an id whose lease is live (another process holds it)."""
        fields = {k: str(v) for k, v in {**asdict(worker), **{k: 0 for k in SCALARS}}.items() if k != "incarnation"}
        answer = await self._register(keys=self._keys(worker.worker_id) + [f"{P}fence"],
                                      args=[worker.worker_id, self.owners.block_prefix, self.ttl_s,
                                            secrets.token_hex(8), *(x for kv in fields.items() for x in kv)])
        if answer == -1:
            raise AlreadyExists(f"worker id {worker.worker_id!r} is held by a live process (its lease has "
                                f"{await self.r.ttl(LEASE_PREFIX + worker.worker_id)}s left)")
        return answer[0].decode() if isinstance(answer[0], bytes) else str(answer[0])

    async def deregister(self, worker_id: str, incarnation: str) -> None:
        if not await self.purge(worker_id, incarnation):
            raise StaleIncarnation(worker_id, incarnation)

    async def purge(self, worker_id: str, incarnation: str = "") -> bool:
        """Drops the worker if it is still in the state the caller saw: registered with
        ``incarnation``, or (``""``) with its lease expired. True if it was dropped."""
        return bool(await self._purge(keys=self._keys(worker_id),
                                      args=[worker_id, self.owners.block_prefix, incarnation]))

    def _keys(self, worker_id: str) -> list[str]:
        return [f"{LEASE_PREFIX}{worker_id}", f"{P}seq:{worker_id}", f"{P}workers", f"{P}unknown",
                f"{P}own:{worker_id}", self.owners.slots_key]

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
        reply = await self._live(keys=[f"{P}workers"], args=[LEASE_PREFIX])
        live = []
        for wid, flat in sorted(zip(reply[::2], reply[1::2])):
            if not flat:
                await self.purge(wid.decode())
                continue
            f = {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}
            worker = WorkerRecord.from_hash(f)
            live.append((worker, Load(**{k: int(f.get(k, 0)) for k in SCALARS})))
        return live

