"""The KV index and membership, in Redis (soft state: workers re-send it all).

Keys (``kervan:`` prefix):

    workers               set of registered worker ids
    w:{id}                hash: the worker's record (address, role, model, incarnation,
                          block_size, hash_name, limits) and load fields; expires
                          unless heartbeats renew it
    seq:{id}              last applied event sequence number of the worker
    slots                 hash: worker id -> its slot in the block bitmaps
    slotsv                counter bumped at every change of slots (matches cache the table)
    generation            a random id per Redis life (``generation.py``)
    blk:{hash hex}        bitmap of the slots of the workers holding that block
                          (``block_owners.py``)
    own:{id}              hash: block hash (hex) -> tier, what the worker holds
    tiered                set of workers that hold blocks in a tier other than the device's
    unknown               set of worker ids whose block sets the registry cannot
                          vouch for (a gap in their events, or the registry
                          restarted) until a full dump replaces them
    fence                 counter of fencing tokens: each registration's incarnation
    cert:{sha256}:{addr}  the worker id a certificate last registered at an address (TLS meshes)
    retired               hash: slot -> the worker whose blocks' bits still carry it
    purging:{slot}        the blocks of a retired slot, cleared in batches (then the slot is free)

A worker whose ``w:{id}`` key expired is dead: its ownership is purged the next
time the live set is read. A worker the registry cannot account for is
"unknown", never "empty": its last known blocks still answer matches, flagged,
and its next heartbeat or publish is told to send a full dump. A block lives in
one tier per worker at a time (a move is sent as removal, then store). Updates go
in pipelines; a prefix match is one round trip. Registration and purges are each
one Lua script (``scripts.py``), so no purge can interleave with a registration; the
scripts that register, renew or drop a worker publish its id on ``scripts.LIVE_CHANNEL``
(``live_feed.py`` streams the live set's changes from it)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from typing import Any

import redis.asyncio as redis

from kervan.kv_events import MEDIUM_DISK, MEDIUM_HOST, BlockRemoved, BlockStored, KVEvent
from kervan.sampling import InvalidRequest, RequestLimits
from kervan.worker_info import WorkerInfo, WorkerRole
from services.common.errors import AlreadyExists, FailedPrecondition, PermissionDenied
from services.common.load import SCALARS, Load
from services.common.worker_leases import KEY_PREFIX, LEASE_PREFIX
from services.kv_registry import scripts
from services.kv_registry.block_owners import BlockOwners

log = logging.getLogger(__name__)
P = KEY_PREFIX
# the registry's bound on one worker's blocks: 4M tokens at 16 per block, ~110 MiB of Redis (2^20 held 433 MiB;
# an 80 GB GPU serving an 8B model holds ~40k blocks)
MAX_BLOCKS_PER_WORKER = 1 << 18
CHUNK_HASHES = 2048  # block hashes per script call: each call holds Redis a few ms at most
SWEEP_BATCH = 2048  # retired blocks cleared per script call
IDENTITY_TTL_S = 86400  # how long a certificate's tie to its worker id outlives the last registration
RETIRED = f"{P}retired"
TIERED = f"{P}tiered"
PURGING = f"{P}purging:"


def record_fields(worker: WorkerInfo) -> dict[str, str]:
    """The worker's Redis hash (its load fields apart): every value a string, limits flat."""
    return {"worker_id": worker.worker_id, "address": worker.address, "role": worker.role.value,
            "model": worker.model, "block_size": str(worker.block_size), "hash_name": worker.hash_name,
            "max_model_len": str(worker.limits.max_model_len), "max_n": str(worker.limits.max_n),
            "kv_capacity_blocks": str(worker.kv_capacity_blocks), "registration_nonce": worker.registration_nonce}


def record_of(f: dict[str, str]) -> WorkerInfo:
    """The record ``record_fields`` stored, less what is never listed: its incarnation (the
    fencing token) and its registration nonce's digest."""
    return WorkerInfo(worker_id=f["worker_id"], address=f["address"], role=WorkerRole(f["role"]), model=f["model"],
                      block_size=int(f["block_size"]), hash_name=f["hash_name"],
                      limits=RequestLimits(max_model_len=int(f["max_model_len"]), max_n=int(f["max_n"])),
                      kv_capacity_blocks=int(f["kv_capacity_blocks"]))


def _chunks(events: list[tuple[str, int, str, list[str]]]) -> list[list]:
    """Script arguments for ``events`` in calls of at most ``CHUNK_HASHES`` hashes each; an
    event larger than that goes on as its rest (``s``/``r``: applied right after it)."""
    chunks: list[list] = [[]]
    room = CHUNK_HASHES
    for kind, seq, tier, hexes in events:
        if room == 0:
            chunks.append([])
            room = CHUNK_HASHES
        start = 0
        while True:
            part = hexes[start:start + room]
            chunks[-1] += [kind if start == 0 else kind.lower(), seq, tier, len(part), *part]
            start += len(part)
            room -= len(part)
            if start >= len(hexes):
                break
            chunks.append([])
            room = CHUNK_HASHES
    return chunks


class StaleIncarnation(FailedPrecondition):
    """A call from a worker process the registry no longer recognises: re-register."""

    def __init__(self, worker_id: str, incarnation: str):
        super().__init__(f"worker {worker_id!r} incarnation {incarnation!r} is not registered; re-register")


class PrefixIndex:
    def __init__(self, client: redis.Redis, ttl_s: int = 5, max_blocks_per_worker: int = MAX_BLOCKS_PER_WORKER):
        self.r = client
        self.ttl_s = ttl_s
        self.max_blocks_per_worker = max_blocks_per_worker
        self._sweeping: asyncio.Task | None = None
        self.owners = BlockOwners(client, P)
        self._renew = client.register_script(scripts.RENEW)
        self._apply = client.register_script(scripts.APPLY)
        self._register = client.register_script(scripts.REGISTER)
        self._purge = client.register_script(scripts.PURGE)
        self._live = client.register_script(scripts.LIVE)
        self._claim = client.register_script(scripts.CLAIM_IDENTITY)
        self._sweep = client.register_script(scripts.SWEEP)

    async def match(self, block_hashes: list[bytes]) -> tuple[dict[str, int], list[str]]:
        """Worker id -> how many leading blocks of the prompt it holds, and the workers
        whose block sets are unknown (their counts are the last known state)."""
        matched, unknown, *_ = await self.match_tiers(block_hashes)
        return matched, unknown

    async def match_tiers(self, block_hashes: list[bytes]
                          ) -> tuple[dict[str, int], list[str], dict[str, int], dict[str, int]]:
        """``match``, and of each worker's matched blocks how many are in its host tier and
        how many on its disk tier (one more round trip, only when a matched worker keeps
        blocks in another tier)."""
        matched, unknown, tiered = await self.owners.match(block_hashes, f"{P}unknown", TIERED)
        looked = [w for w in matched if w in tiered and matched[w]]
        if not looked:
            return matched, unknown, {}, {}
        async with self.r.pipeline(transaction=False) as pipe:
            for w in looked:
                pipe.hmget(f"{P}own:{w}", [h.hex() for h in block_hashes[:matched[w]]])
            tiers = await pipe.execute()
        counts = [(w, sum(t == MEDIUM_HOST.encode() for t in ts), sum(t == MEDIUM_DISK.encode() for t in ts))
                  for w, ts in zip(looked, tiers)]
        return matched, unknown, {w: h for w, h, _ in counts if h}, {w: d for w, _, d in counts if d}

    async def forget_all(self) -> None:
        """On registry start: nothing in Redis is vouched for until each worker's dump."""
        self.sweep_soon()  # a registry that died mid-sweep left retired slots
        workers = await self.r.smembers(f"{P}workers")
        if workers:
            await self.r.sadd(f"{P}unknown", *workers)

    async def register(self, worker: WorkerInfo) -> str:
        """Registers a worker under a new fencing token (its incarnation), returned;
        refuses an id whose lease is live (another process holds it)."""
        fields = {**record_fields(worker), **{k: "0" for k in SCALARS}}
        answer = await self._register(keys=self._keys(worker.worker_id) + [f"{P}fence"],
                                      args=[worker.worker_id, self.owners.block_prefix, PURGING, self.ttl_s,
                                            secrets.token_hex(8), worker.registration_nonce,
                                            *(x for kv in fields.items() for x in kv)])
        self.sweep_soon()
        if answer == -1:
            raise AlreadyExists(f"worker id {worker.worker_id!r} is held by a live process (its lease has "
                                f"{await self.r.ttl(LEASE_PREFIX + worker.worker_id)}s left)")
        return answer[0].decode() if isinstance(answer[0], bytes) else str(answer[0])

    async def claim_identity(self, identity: str, address: str, worker_id: str) -> None:
        """Ties a certificate's identity and ``address`` to ``worker_id``; refuses another id
        while the one they hold has a live lease (one live registration per certificate and
        address; workers sharing a certificate register their own addresses)."""
        key = f"{P}cert:{identity}:{hashlib.sha256(address.encode()).hexdigest()[:32]}"
        answer = await self._claim(keys=[key], args=[worker_id, LEASE_PREFIX, IDENTITY_TTL_S])
        if answer != b"ok" and answer != "ok":
            held = answer.decode() if isinstance(answer, bytes) else str(answer)
            raise PermissionDenied(f"this certificate holds the live registration of worker {held!r} at "
                                   f"{address}: one worker per certificate and address")

    async def deregister(self, worker_id: str, incarnation: str) -> None:
        if not await self.purge(worker_id, incarnation):
            raise StaleIncarnation(worker_id, incarnation)

    async def purge(self, worker_id: str, incarnation: str = "") -> bool:
        """Drops the worker if it is still in the state the caller saw: registered with
        ``incarnation``, or (``""``) with its lease expired. True if it was dropped."""
        purged = bool(await self._purge(keys=self._keys(worker_id),
                                        args=[worker_id, self.owners.block_prefix, PURGING, incarnation]))
        self.sweep_soon()
        return purged

    async def purge_expired(self) -> list[str]:
        """Drops every registered worker whose lease expired, with its KV ownership; their ids."""
        expired = [wid for wid, flat in await self.registered() if not flat]
        return [wid for wid in expired if await self.purge(wid)]

    async def registered(self) -> list[tuple[str, list]]:
        """Every registered worker id, by id, with its lease hash flattened (empty: expired)."""
        reply = await self._live(keys=[f"{P}workers"], args=[LEASE_PREFIX])
        return sorted((wid.decode(), flat) for wid, flat in zip(reply[::2], reply[1::2]))

    def sweep_soon(self) -> None:
        """Clear retired slots' block bits in the background, a batch per script call."""
        if self._sweeping is None or self._sweeping.done():
            self._sweeping = asyncio.get_running_loop().create_task(self.sweep())

    async def sweep(self) -> None:
        try:
            while await self._sweep(keys=[RETIRED], args=[self.owners.block_prefix, PURGING, SWEEP_BATCH]):
                await asyncio.sleep(0)  # other calls run between batches
        except redis.RedisError as err:  # the next registration, purge or listing sweeps again
            log.warning("sweeping retired KV ownership stopped: %s", err)

    def _keys(self, worker_id: str) -> list[str]:
        return [f"{LEASE_PREFIX}{worker_id}", f"{P}seq:{worker_id}", f"{P}workers", f"{P}unknown",
                f"{P}own:{worker_id}", self.owners.slots_key, RETIRED, TIERED, self.owners.version_key]

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
        ops = [("S" if isinstance(e, BlockStored) else "R" if isinstance(e, BlockRemoved) else "C", e.seq,
                getattr(e, "medium", ""), [h.hex() for h in getattr(e, "block_hashes", [])]) for e in events]
        last, unknown, gap = 0, False, False
        chunks = _chunks(ops)
        if len(chunks) > 1:  # each call checks its own chunk: see the whole fits before the first writes
            await self._check_room(worker_id, ops)
        for chunk in chunks:
            last, unknown, chunk_gap = await self._write(worker_id, incarnation, chunk)
            gap = gap or chunk_gap
        if any(kind == "C" for kind, *_ in ops):
            self.sweep_soon()  # the clear retired the worker's old slot
        if gap:
            log.warning("worker %s: KV events missing (batch %d..%d); asking for a full dump", worker_id,
                        events[0].seq, events[-1].seq)
        return last, unknown

    async def _check_room(self, worker_id: str, ops: list) -> None:
        """Refuse events that would leave the worker past its capacity (APPLY's own bound), before
        any of them is written: a refused call once wrote 56 MiB in the chunks before its refusal."""
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.hlen(f"{P}own:{worker_id}")
            pipe.hget(f"{LEASE_PREFIX}{worker_id}", "kv_capacity_blocks")
            held, declared = await pipe.execute()
        cap = min(int(declared or 0) or self.max_blocks_per_worker, self.max_blocks_per_worker)
        for kind, _, _, hexes in ops:
            held = 0 if kind == "C" else held + len(hexes) if kind == "S" else held
            if held > cap + cap // 10 + 64:
                raise InvalidRequest(f"worker {worker_id!r} would hold more KV blocks than its capacity "
                                     f"(kv_capacity_blocks, at most {self.max_blocks_per_worker})")

    async def replace_blocks(self, worker_id: str, incarnation: str, seq: int, tiers: dict[str, list[bytes]]) -> int:
        """A full dump, as of event ``seq``: becomes all the registry knows of the worker."""
        ops = [("C", seq, "", []), *(("S", seq, tier, [h.hex() for h in hashes]) for tier, hashes in tiers.items())]
        chunks = _chunks(ops)
        for k, chunk in enumerate(chunks):
            await self._write(worker_id, incarnation, chunk, mode="2" if k == len(chunks) - 1 else "1")
        self.sweep_soon()  # the clear retired the worker's old slot
        return len({h for hashes in tiers.values() for h in hashes})

    async def _write(self, worker_id: str, incarnation: str, ops: list, mode: str = "0") -> tuple[int, bool, bool]:
        own = f"{P}own:{worker_id}"
        answer = await self._apply(keys=[f"{LEASE_PREFIX}{worker_id}", own, f"{P}seq:{worker_id}", f"{P}unknown",
                                         TIERED, self.owners.slots_key, RETIRED, self.owners.version_key],
                                   args=[incarnation, self.owners.block_prefix, PURGING, mode, worker_id,
                                         self.max_blocks_per_worker, *ops])
        if answer == -1:
            raise StaleIncarnation(worker_id, incarnation)
        if answer == -2:
            raise InvalidRequest(f"worker {worker_id!r} would hold more KV blocks than its capacity "
                                 f"(kv_capacity_blocks, at most {self.max_blocks_per_worker})")
        if answer == -3:
            raise InvalidRequest(f"KV event seqs of worker {worker_id!r} jump more than {scripts.MAX_SEQ_JUMP} past "
                                 f"the last one applied")
        return int(answer[0]), bool(answer[1]), bool(answer[2])

    async def live_workers(self) -> list[tuple[WorkerInfo, Load]]:
        """Registered workers whose registration has not expired (a read: expired ones are
        left out, not purged; ``purge_expired`` drops them)."""
        return decode_live(await self.registered())


def decode_live(registered: list[tuple[str, list]]) -> list[tuple[WorkerInfo, Load]]:
    """``PrefixIndex.registered``'s leases, the expired left out, as records and loads: pure
    Python work that grows with the mesh (tens of ms at 1,000 workers), which the registry
    runs off its event loop."""
    live = []
    for _, flat in registered:
        if not flat:
            continue
        f = {flat[i].decode(): flat[i + 1].decode() for i in range(0, len(flat), 2)}
        scalars: dict[str, Any] = {k: int(f.get(k, 0)) for k in SCALARS}
        live.append((record_of(f), Load(**scalars)))
    return live

