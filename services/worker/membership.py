"""A worker's side of membership: register with the kv-registry, heartbeat its
load every second (and within ``load_interval_s`` of a change, so that placement
sees queues as they build), and publish its KV events as they happen (polled from the
engine thread every ``event_interval_s``). A registry that no longer recognises
this incarnation (this worker was declared dead) is answered by registering again
and sending a full dump of its cached blocks; so is a registry that lost track of
them (a gap in the events, or a registry restart) and says so in a response.

The incarnation is a fencing token the registry issues with each registration;
every call names it, so a worker that lost its lease cannot write as the one that
registered after it. An id still held by a live lease (this worker's previous
process, SIGKILLed a moment ago) is refused: registration retries until that lease
runs out, ``register_timeout_s`` at most.

An engine that no longer serves (``AsyncEngine.health``) takes the worker out of
the mesh at once: it deregisters, stops heartbeating, and ``on_unhealthy`` runs
(the worker process exits, for its supervisor to restart it)."""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from collections.abc import Callable

import grpc

from kervan.block_hash import HASH_NAME
from kervan.kv_events import MEDIUM_DEVICE, KVEvent
from kervan.worker_info import WorkerInfo, WorkerRole
from services.common.convert import event_to_proto, load_to_proto, tier_to_proto, worker_info_to_proto
from services.common.load import Load
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc
from services.worker.async_engine import AsyncEngine

log = logging.getLogger(__name__)
# a registration is retried on these: another process's lease that has yet to end, or a
# registry (or its Redis) that did not answer in time
RETRIED = {grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class Membership:
    def __init__(self, registry: kv_registry_pb2_grpc.KvRegistryServiceStub, engine: AsyncEngine, address: str,
                 role: WorkerRole, model: str, heartbeat_s: float = 1.0, event_interval_s: float = 0.02,
                 load_interval_s: float = 0.1, register_timeout_s: float = 30.0,
                 on_unhealthy: Callable[[str], None] | None = None):
        self.registry = registry
        self.engine = engine
        role = WorkerRole(role)
        self.info = worker_info_to_proto(WorkerInfo(
            worker_id=WorkerInfo.id_of(role, address), address=address, role=role, model=model,
            block_size=engine.block_size, hash_name=HASH_NAME, limits=engine.limits,
            kv_capacity_blocks=_capacity(engine.stats()), registration_nonce=secrets.token_hex(16)))
        self.heartbeat_s = heartbeat_s
        self.event_interval_s = event_interval_s
        self.load_interval_s = load_interval_s
        self.register_timeout_s = register_timeout_s
        self.on_unhealthy = on_unhealthy
        self._registering = asyncio.Lock()  # the beat and event loops may both learn they are stale
        self.ejected: str | None = None  # why this worker left the mesh on its own
        self._reported: Load | None = None
        self._dump_wanted = False

    async def register(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.register_timeout_s
        while True:
            try:
                reply = await self.registry.Register(kv_registry_pb2.RegisterRequest(worker=self.info), timeout=5)
                break
            except grpc.aio.AioRpcError as err:  # asked again with its nonce: a landed first try is given back
                if err.code() not in RETRIED or loop.time() > deadline:
                    raise
                log.warning("%s; registering again", err.details() or err.code().name)
                await asyncio.sleep(0.5)
        self.info.incarnation = reply.incarnation

    async def deregister(self) -> None:
        """Leave the mesh before draining, so that nothing new is placed here."""
        try:
            await self.registry.Deregister(kv_registry_pb2.DeregisterRequest(
                worker_id=self.info.worker_id, incarnation=self.info.incarnation), timeout=2)
        except grpc.aio.AioRpcError as err:  # the registry will expire this worker by itself
            log.warning("could not deregister: %s", err.code().name)

    async def run(self) -> None:
        """Heartbeats and event publishing until cancelled (registering first unless
        registered): two loops, so that lease renewal never waits for the engine thread
        (a long step cannot starve it)."""
        if not self.info.incarnation:
            await self.register()
        beats = asyncio.ensure_future(self._beat_loop())
        events = asyncio.ensure_future(self._event_loop())
        try:
            await beats  # ends only when the engine no longer serves
        finally:
            events.cancel()
            await asyncio.gather(events, return_exceptions=True)

    async def _beat_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last_beat = 0.0
        while True:
            why = self.engine.health()
            if why is not None:
                log.critical("leaving the mesh: %s", why)
                self.ejected = why
                await self.deregister()
                if self.on_unhealthy is not None:
                    self.on_unhealthy(why)
                return
            since = loop.time() - last_beat
            if since >= self.heartbeat_s or (since >= self.load_interval_s and self.engine.load() != self._reported):
                if await self._guarded(self._heartbeat):
                    self._dump_wanted = True
                last_beat = loop.time()
            await asyncio.sleep(min(self.load_interval_s, self.heartbeat_s) / 2)

    async def _event_loop(self) -> None:
        while True:
            events = await self.engine.call(lambda e: e.take_events())
            if events and await self._guarded(functools.partial(self._publish, events)):
                self._dump_wanted = True
            if self._dump_wanted:
                self._dump_wanted = False
                await self._guarded(self._dump)
            await asyncio.sleep(self.event_interval_s)

    async def _guarded(self, call) -> bool:
        """``call()``'s answer; False when the registry failed it. A registry that no
        longer knows this incarnation gets a new registration (and then a dump), once:
        the other loop may have registered again already (its new lease would refuse
        a second registration as a live duplicate)."""
        token = self.info.incarnation
        try:
            return bool(await call())
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                async with self._registering:
                    if self.info.incarnation != token:
                        return False  # registered again meanwhile
                    log.warning("registry does not know this incarnation; registering again")
                    try:
                        await self.register()
                        self._dump_wanted = True  # the registry starts from nothing for this worker
                    except grpc.aio.AioRpcError as again:
                        log.warning("registering again failed: %s", again.code().name)
            else:
                log.warning("registry unreachable: %s", err.code().name)
                await asyncio.sleep(self.heartbeat_s)
            return False

    async def _publish(self, events: list[KVEvent]) -> bool:
        """Send events; True when the registry asks for a full dump."""
        reply = await self.registry.PublishEvents(kv_registry_pb2.PublishEventsRequest(
            worker_id=self.info.worker_id, incarnation=self.info.incarnation,
            events=[event_to_proto(e) for e in events]), timeout=5)
        return reply.needs_full_dump

    async def _heartbeat(self) -> bool:
        """Renew and report load; True when the registry asks for a full dump."""
        load = self.engine.load()
        reply = await self.registry.Heartbeat(kv_registry_pb2.HeartbeatRequest(
            worker_id=self.info.worker_id, incarnation=self.info.incarnation, load=load_to_proto(load)), timeout=5)
        self._reported = load
        return reply.needs_full_dump

    async def _dump(self) -> None:
        (seq, cached), lower = await self.engine.call(lambda e: (e.cached_blocks(), e.tier_blocks()))
        tiers = [kv_registry_pb2.TierBlocks(tier=tier_to_proto(MEDIUM_DEVICE), block_hashes=cached)]
        tiers += [kv_registry_pb2.TierBlocks(tier=tier_to_proto(tier), block_hashes=hashes)
                  for tier, hashes in lower.items() if hashes]
        reply = await self.registry.ReportBlocks(kv_registry_pb2.ReportBlocksRequest(
            worker_id=self.info.worker_id, incarnation=self.info.incarnation, seq=seq, tiers=tiers), timeout=30)
        log.info("sent a full dump of %d blocks (as of event %d)", reply.num_blocks, seq)


def _capacity(stats) -> int:
    """The blocks the worker may hold at once, its tiers behind the pool included: the
    registry refuses events that would leave it holding more."""
    return getattr(stats, "kv_capacity_blocks", 0) or stats.num_blocks
