"""KvRegistryService: protobuf in, ``PrefixIndex`` call, protobuf out; it also checks that a
registering worker agrees with the mesh (block size, hash function) and, through
``Generations``, notices a Redis that restarted empty.

Every count and size a caller sends is bounded before Redis sees it (one Lua script
runs alone in Redis: a million hashes in one call would stall every other client),
and the fencing tokens stay private: ``ListWorkers`` never lists them."""

from __future__ import annotations

import asyncio
import dataclasses

from kervan.sampling import InvalidRequest
from services.common.convert import (
    event_from_proto,
    load_from_proto,
    load_to_proto,
    tier_from_proto,
    worker_info_from_proto,
    worker_info_to_proto,
)
from services.common.errors import FailedPrecondition, Overloaded
from services.kv_registry.generation import Generations
from services.kv_registry.identity import nonce_digest, registration_identity
from services.kv_registry.index import PrefixIndex, decode_live
from services.kv_registry.live_feed import LiveFeed
from services.proto import common_pb2, kv_registry_pb2, kv_registry_pb2_grpc

# which mesh roles may call what (services/common/auth.py): only workers write
CALLERS = {"ListWorkers": ("scheduler", "control-plane", "worker", "router", "admin"), "Match": ("scheduler", "admin"),
           "WatchWorkers": ("scheduler", "control-plane", "admin"),
           "GetMeshConfig": ("scheduler", "control-plane", "worker", "admin"),
           "PurgeExpired": ("control-plane", "admin"), "*": ("worker",)}
MAX_ID_CHARS = 256
MAX_HASH_BYTES = 64
MAX_EVENTS = 4096  # per PublishEvents
MAX_HASHES = 1 << 18  # per call: a worker's whole cache in a dump (4M tokens at 16 per block)
MAX_MATCH_HASHES = 1 << 16


def check_hashes(hashes, limit: int, what: str) -> None:
    if len(hashes) > limit:
        raise Overloaded(f"{what} carries {len(hashes)} block hashes, more than {limit}; send fewer per call")
    if any(not 0 < len(h) <= MAX_HASH_BYTES for h in hashes):
        raise InvalidRequest(f"{what}: a block hash is 1-{MAX_HASH_BYTES} bytes")


def listing(registered: list) -> kv_registry_pb2.ListWorkersResponse:
    out = kv_registry_pb2.ListWorkersResponse()
    for record, load in decode_live(registered):
        out.workers.add(info=worker_info_to_proto(record), load=load_to_proto(load))
    return out


class KvRegistryServicer(kv_registry_pb2_grpc.KvRegistryServiceServicer):
    def __init__(self, index: PrefixIndex, block_size: int, hash_name: str, require_worker_addresses: bool = False,
                 watch_resync_s: float = 0.5):
        self.index = index
        self.require_worker_addresses = require_worker_addresses
        self.generations = Generations(index.r, index.owners.generation_key, grace_s=2.0 * index.ttl_s)
        self.feed = LiveFeed(index, self.generations, resync_s=watch_resync_s)
        self._last_live: list[kv_registry_pb2.LiveWorker] = []
        self.block_size = block_size
        self.hash_name = hash_name

    async def Register(self, request, context) -> kv_registry_pb2.RegisterResponse:
        w = worker_info_from_proto(request.worker)
        if (w.block_size, w.hash_name) != (self.block_size, self.hash_name):
            raise FailedPrecondition(
                f"worker {w.worker_id!r} hashes blocks of {w.block_size} tokens with {w.hash_name!r}; this mesh uses "
                f"{self.block_size} tokens with {self.hash_name!r}")
        if not (w.worker_id and w.address):
            raise InvalidRequest("worker_id and address are required")
        if max(len(w.worker_id), len(w.address), len(w.model)) > MAX_ID_CHARS:
            raise InvalidRequest(f"worker_id, address and model are at most {MAX_ID_CHARS} characters")
        for name in ("worker_id", "address", "model"):  # they reach logs and metrics labels
            if not getattr(w, name).isprintable():
                raise InvalidRequest(f"{name} must be printable text, without control characters")
        identity = registration_identity(context, w, self.require_worker_addresses)
        if identity is not None:
            await self.index.claim_identity(identity, w.address, w.worker_id)
        token = await self.index.register(dataclasses.replace(
            w, registration_nonce=nonce_digest(w.registration_nonce, identity)))
        return kv_registry_pb2.RegisterResponse(ttl_s=self.index.ttl_s, incarnation=token)

    async def Deregister(self, request, context) -> kv_registry_pb2.DeregisterResponse:
        await self.index.deregister(request.worker_id, request.incarnation)
        return kv_registry_pb2.DeregisterResponse()

    async def Heartbeat(self, request, context) -> kv_registry_pb2.HeartbeatResponse:
        dump = await self.index.heartbeat(request.worker_id, request.incarnation, load_from_proto(request.load))
        return kv_registry_pb2.HeartbeatResponse(needs_full_dump=dump)

    async def PublishEvents(self, request, context) -> kv_registry_pb2.PublishEventsResponse:
        if len(request.events) > MAX_EVENTS:
            raise Overloaded(f"PublishEvents carries {len(request.events)} events, more than {MAX_EVENTS}")
        check_hashes([h for e in request.events for h in (e.stored.block_hashes or e.removed.block_hashes)],
                     MAX_HASHES, "PublishEvents")
        events = [event_from_proto(e) for e in request.events]
        last, dump = await self.index.apply(request.worker_id, request.incarnation, events)
        return kv_registry_pb2.PublishEventsResponse(last_seq=last, needs_full_dump=dump)

    async def ReportBlocks(self, request, context) -> kv_registry_pb2.ReportBlocksResponse:
        check_hashes([h for t in request.tiers for h in t.block_hashes], MAX_HASHES, "ReportBlocks")
        tiers: dict[str, list[bytes]] = {}
        for t in request.tiers:
            tiers.setdefault(tier_from_proto(t.tier), []).extend(t.block_hashes)
        n = await self.index.replace_blocks(request.worker_id, request.incarnation, request.seq, tiers)
        return kv_registry_pb2.ReportBlocksResponse(num_blocks=n)

    async def Match(self, request, context) -> kv_registry_pb2.MatchResponse:
        check_hashes(request.block_hashes, MAX_MATCH_HASHES, "Match")
        matched, unknown, host, disk = await self.index.match_tiers(list(request.block_hashes))
        return kv_registry_pb2.MatchResponse(matched_blocks=matched, unknown_workers=unknown, host_blocks=host,
                                             disk_blocks=disk)

    async def GetMeshConfig(self, request, context) -> kv_registry_pb2.GetMeshConfigResponse:
        return kv_registry_pb2.GetMeshConfigResponse(
            config=common_pb2.MeshConfig(block_size=self.block_size, hash_name=self.hash_name))

    async def PurgeExpired(self, request, context) -> kv_registry_pb2.PurgeExpiredResponse:
        return kv_registry_pb2.PurgeExpiredResponse(worker_ids=await self.index.purge_expired())

    async def WatchWorkers(self, request, context):
        async for message in self.feed.watch():
            yield message

    async def ListWorkers(self, request, context) -> kv_registry_pb2.ListWorkersResponse:
        await self.generations.check()
        # decoding a large mesh's leases is tens of ms of Python: in a thread, so that the
        # Match calls placements wait on interleave with it instead of queueing behind it
        out = await asyncio.to_thread(listing, await self.index.registered())
        back = {w.info.worker_id for w in out.workers}
        if not self.generations.rebuilding and any(w.info.worker_id not in back for w in self._last_live):
            await self.generations.check(force=True)  # workers gone: a cached check would miss an empty Redis
        if self.generations.rebuilding:  # Redis came back empty: the workers not back yet still serve
            out.workers.extend(w for w in self._last_live if w.info.worker_id not in back)
        else:
            self._last_live = list(out.workers)
        return out
