"""The live mesh as the mesh page (``GET /mesh``) shows it, read from the sources the metrics
come from: the kv-registry's live set (each worker's heartbeat load, the numbers behind
``kervan_kv_cache_usage_perc`` and the tier gauges), the scheduler's placement counts
(``kervan_placements``'s), and this router's own journal of recent placements and migrations.
A source that does not answer is named in ``unavailable``; the rest is still shown."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from services.common.convert import load_from_proto, role_from_proto
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.router.mesh_journal import MeshJournal

SOURCE_TIMEOUT_S = 2.0


class MeshView:
    def __init__(self, model: str, journal: MeshJournal,
                 registry: kv_registry_pb2_grpc.KvRegistryServiceStub | None = None,
                 scheduler: scheduler_pb2_grpc.SchedulerServiceStub | None = None):
        self.model, self.journal, self.registry, self.scheduler = model, journal, registry, scheduler

    async def state(self, in_flight: int) -> dict[str, Any]:
        unavailable: list[str] = []
        workers, placements = await asyncio.gather(self._workers(unavailable), self._placement_counts(unavailable))
        return {"model": self.model, "at": time.time(), "router": {"in_flight": in_flight},
                "workers": workers, "placement_counts": placements, **self.journal.recent(),
                "unavailable": unavailable}

    async def _workers(self, unavailable: list[str]) -> list[dict[str, Any]]:
        if self.registry is None:
            unavailable.append("kv-registry (the router was not given --registry)")
            return []
        try:
            listed = await self.registry.ListWorkers(kv_registry_pb2.ListWorkersRequest(), timeout=SOURCE_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            unavailable.append(f"kv-registry ({err.code().name})")
            return []
        return sorted((_worker(w) for w in listed.workers), key=lambda w: (w["role"], w["address"]))

    async def _placement_counts(self, unavailable: list[str]) -> dict[str, Any]:
        if self.scheduler is None:
            return {}
        try:
            stats = await self.scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=SOURCE_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            unavailable.append(f"scheduler ({err.code().name})")
            return {}
        return {"placements": stats.placements, "refused": stats.refused, "by_reason": dict(stats.by_prefill_reason),
                "by_worker": dict(stats.by_worker)}


def _worker(live: kv_registry_pb2.LiveWorker) -> dict[str, Any]:
    info, load = live.info, load_from_proto(live.load)
    host = info.address.rsplit(":", 1)[0]
    return {"id": info.worker_id, "role": str(role_from_proto(info.role)), "address": info.address, "host": host,
            "running": load.num_running, "waiting": load.num_waiting, "requests": load.num_requests,
            "max_requests": load.max_requests, "prefill_queue_tokens": load.num_prefill_tokens,
            "kv": {"pool_used": load.num_blocks - load.num_free_blocks, "pool": load.num_blocks,
                   "pool_cached": load.num_evictable_blocks,
                   "host": load.num_host_blocks, "disk": load.num_disk_blocks},
            "prefill_tokens_per_s": load.prefill_tokens_per_s}
