"""SchedulerService: ask the kv-registry for live workers and prefix overlap, then place."""

from __future__ import annotations

import asyncio

from services.common.errors import Unavailable
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.placement import Candidate, PlacementConfig, place


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, registry: kv_registry_pb2_grpc.KvRegistryServiceStub, config: PlacementConfig):
        self.registry = registry
        self.config = config
        self.num_decode_only_fallbacks = 0

    async def Place(self, request: scheduler_pb2.PlaceRequest, context) -> scheduler_pb2.PlaceResponse:
        timeout = context.time_remaining()
        workers, match = await asyncio.gather(
            self.registry.ListWorkers(kv_registry_pb2.ListWorkersRequest(), timeout=timeout),
            self.registry.Match(kv_registry_pb2.MatchRequest(block_hashes=request.block_hashes), timeout=timeout))
        candidates = [Candidate(w.info.worker_id, w.info.address, w.info.role,
                                match.matched_blocks.get(w.info.worker_id, 0), w.load.num_blocks - w.load.num_free_blocks)
                      for w in workers.workers]
        decision = place(candidates, len(request.block_hashes), self.config)
        if decision is None:
            raise Unavailable("no healthy decode or aggregated worker is registered")
        self.num_decode_only_fallbacks += decision.fallback
        return scheduler_pb2.PlaceResponse(
            decode_address=decision.decode.address,
            prefill_address=decision.prefill.address if decision.prefill else "",
            cached_blocks=decision.cached_blocks, scores=decision.scores)
