"""SchedulerService: ask the kv-registry for live workers (with the limits each
registered) and prefix overlap, then place; a request no worker's limits hold is
refused here, with INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter
from dataclasses import replace

import grpc
from opentelemetry import trace

from kervan.worker_info import WorkerRole
from services.common.errors import Overloaded, Unavailable
from services.proto import common_pb2, kv_registry_pb2, kv_registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.scheduler import metrics
from services.scheduler.live_view import EMPTY, View, WorkerWatch, listed
from services.scheduler.placement import AllBusy, Candidate, Decision, PlacementConfig, Size, cost, place
from services.scheduler.policies import make_policy
from services.scheduler.recent import RecentPlacements
from services.scheduler.shortlist import Touched, best_plain, walk_touched

log = logging.getLogger(__name__)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, registry: kv_registry_pb2_grpc.KvRegistryServiceStub, config: PlacementConfig, *,
                 recent: RecentPlacements | None = None, seed: int | None = None, max_ejection_share: float = 0.5,
                 panic_threshold: float = 0.5, workers_cache_s: float = 0.05, shortlist: bool = True,
                 watch: bool = False):
        self.registry = registry
        self.config = config
        self.recent = recent or RecentPlacements()
        self.policy = make_policy(config, random.Random(seed))
        self.stale_workers_s = 30.0
        self.registry_timeout_s = 2.0  # a slow registry (a slow Redis behind it) is taken for a down one
        self.max_ejection_share = max_ejection_share
        self.panic_threshold = panic_threshold
        self._last_view: tuple[View, float] = (EMPTY, float("-inf"))  # the live set last seen, and when
        # with ``watch``, the live set is kept from the registry's stream of its changes
        # (live_view.py); without (or while the stream is down), it is listed and shared:
        # placements within workers_cache_s of a listing reuse it, and placements while one is
        # in flight wait for it (ListWorkers costs a round trip per worker in Redis and a
        # message of them all: at 1,000 workers, a per-call listing made the scheduler serve 8
        # placements a second; benchmarks/place_path.py)
        self.watch = WorkerWatch(registry) if watch else None
        self.workers_cache_s = workers_cache_s
        self.shortlist = shortlist  # price only the shortlist's workers where the policy allows (shortlist.py)
        self._listing: asyncio.Future | None = None
        self._listing_s = 0.0  # how long the last listing took
        self.placements = 0
        self.refused = 0  # requests refused because every decode worker was at its limit
        self.by_reason: Counter[str] = Counter()
        self.by_branch: Counter[str] = Counter()  # the policy's rule that chose, for policies that name one
        self.by_worker: Counter[str] = Counter()
        self._mesh_config = None  # the registry's block size and hash function (GetMeshConfig)

    async def Place(self, request: scheduler_pb2.PlaceRequest, context) -> scheduler_pb2.PlaceResponse:
        view, match = await self._registry_view(request, context.time_remaining())
        hashes = list(request.block_hashes)
        candidates, decision = self._decide(view, match, request, hashes)
        if decision is None:
            # a view kept or reused from before a worker joined may hold only the workers this
            # request excludes (a request moved twice, each time to a replacement): list afresh
            # before saying that no worker is there
            try:
                view = await self._list(self.registry_timeout_s)
                candidates, decision = self._decide(view, match, request, hashes)
            except grpc.aio.AioRpcError:  # the registry is down: the view seen is all there is
                pass
        if decision is None:
            model = f" for model {request.model!r}" if request.model else ""
            raise Unavailable(f"no healthy decode or aggregated worker is registered{model}")
        num_blocks = len(hashes)
        reported = view.reported
        if log.isEnabledFor(logging.DEBUG):  # Dynamo's per-worker formula log: why this worker won
            log.debug("place %s: decode %s prefill %s (%s), %d of %d blocks cached; per worker (cost, matched, "
                      "active, free): %s", request.request_id, decision.decode.worker_id,
                      decision.prefill.worker_id if decision.prefill else "-", decision.reason,
                      decision.cached_blocks, num_blocks,
                      {c.worker_id: (round(decision.scores.get(c.worker_id, math.nan), 1), c.matched_blocks,
                                     c.active_blocks, c.free_blocks) for c in candidates})
        if not request.dry_run:
            prefill_tokens = request.num_prompt_tokens - decision.cached_blocks * view.block_size
            if decision.prefill:
                self.recent.add(decision.prefill.worker_id, prefill_tokens=prefill_tokens, block_hashes=hashes)
            self.recent.add(decision.decode.worker_id, prefill_tokens=0 if decision.prefill else prefill_tokens,
                            blocks=num_blocks - decision.decode.matched_blocks + 1, block_hashes=hashes)
            self.policy.placed(decision.decode.worker_id, hashes, (c.worker_id for c in reported))
            self.placements += 1
            self.by_reason[decision.reason] += 1
            if decision.branch:
                self.by_branch[decision.branch] += 1
            metrics.PLACEMENTS.labels(decision.reason).inc()
            metrics.KV_FETCHES.inc(decision.fetch is not None)
            self.by_worker.update({c.worker_id for c in (decision.decode, decision.prefill) if c})
        trace.get_current_span().set_attributes({
            "kervan.request_id": request.request_id, "kervan.placement.reason": decision.reason,
            "kervan.placement.decode_worker": decision.decode.worker_id,
            "kervan.placement.prefill_worker": decision.prefill.worker_id if decision.prefill else "",
            "kervan.placement.cached_blocks": decision.cached_blocks,
            "kervan.placement.fetched_blocks": decision.fetch.num_blocks if decision.fetch else 0,
            "kervan.placement.scores": [f"{w}={v:.2f}" for w, v in sorted(decision.scores.items())]})
        return scheduler_pb2.PlaceResponse(
            decode_address=decision.decode.address,
            prefill_address=decision.prefill.address if decision.prefill else "",
            cached_blocks=decision.cached_blocks, scores=decision.scores, prefill_reason=decision.reason,
            decode_worker_id=decision.decode.worker_id,
            prefill_worker_id=decision.prefill.worker_id if decision.prefill else "",
            unknown_workers=match.unknown_workers, kv_source=_kv_source(decision))

    def _decide(self, view: View, match: kv_registry_pb2.MatchResponse, request: scheduler_pb2.PlaceRequest,
                hashes: list[bytes]) -> tuple[list[Candidate], Decision | None]:
        """The candidates of ``view`` for the request, and the policy's choice (None: no worker
        could take it)."""
        excluded = set(request.exclude_addresses)
        reported = view.reported
        pool = [c for c in reported if c.address not in excluded] if excluded else reported
        pool = self._avoiding(pool, list(request.avoid_addresses))
        size = Size(num_prompt_tokens=request.num_prompt_tokens, max_tokens=request.max_tokens, n=request.n or 1)
        started = time.perf_counter()
        candidates = self._candidates(view, pool, hashes, match, request.model, size, len(pool) < len(reported))
        try:
            return candidates, place(candidates, len(hashes), self.policy, model=request.model, size=size,
                                     block_hashes=hashes, turn=self.placements, block_size=view.block_size)
        except AllBusy as busy:
            self.refused += not request.dry_run
            metrics.REFUSALS.inc(not request.dry_run)
            raise Overloaded(f"{busy}; retry later") from None
        finally:
            metrics.DECISION_TIME.observe(time.perf_counter() - started)

    def _candidates(self, view: View, pool: list[Candidate], hashes: list[bytes], match: kv_registry_pb2.MatchResponse,
                    model: str, size: Size, cut: bool) -> list[Candidate]:
        """The workers placement prices: with the policy's own memory, every one; else the
        touched ones (holding part of the prompt, or placed on lately) with what they hold
        and have pending, and — where the policy allows (``shortlist.py``) — of the plain
        rest only each role's best, else all. ``cut``: the pool lacks listed workers."""
        if self.policy.remembers:
            remembered = [self.policy.remembered_blocks(c.worker_id, hashes) for c in pool]
            known = [r for r in remembered if r is not None]
            if len(known) == len(pool):  # the policy's own memory, never what workers report
                return [self._candidate(c, r) for c, r in zip(pool, known)]
        matched, host, disk = dict(match.matched_blocks), dict(match.host_blocks), dict(match.disk_blocks)
        loaded = set(self.recent.loaded_workers())
        holders = set(self.recent.holders(hashes[0])) if hashes else set()
        touched = {w for w, n in matched.items() if n} | loaded | holders
        if self.config.new_prefix == "content":  # every worker's recent content counts
            touched.update(c.worker_id for c in pool if self.recent.sent_blocks(c.worker_id))

        def held(w: str) -> int:
            return max(matched.get(w, 0), self.recent.predicted_blocks(w, hashes)) if w in holders else \
                matched.get(w, 0)

        def priced(c: Candidate) -> Candidate:
            w = c.worker_id
            return self._candidate(c, held(w), host.get(w, 0), disk.get(w, 0))
        if not (self.shortlist and self.policy.prunable):
            return [priced(c) if c.worker_id in touched else c for c in pool]
        absent = view.by_id.keys() - {c.worker_id for c in pool} if cut else set()  # excluded or avoided: no candidates
        skip = touched | absent
        by_id, order, cfg = view.by_id, view.order, self.config
        prefill_size = Size(num_prompt_tokens=size.num_prompt_tokens, max_tokens=1)
        decode = best_plain(order, skip, len(hashes), cfg, model, size, prefill=False)
        prefill = best_plain(order, skip, len(hashes), cfg, model, prefill_size, prefill=True)
        if decode.worker is None or prefill.lacked_room and prefill.worker is None:  # errors, refusals, no room
            return [priced(c) if c.worker_id in touched else c for c in pool]
        plain = [c for best in (decode, prefill) if (c := best.worker or best.full) is not None]
        if cfg.pull_block_cost > 0:  # the prefix's best holder may be any of them
            return [priced(by_id[w]) for w in sorted(touched) if w in by_id and w not in absent] + plain
        bounds, scale, n, get = [], cfg.overlap_weight + 1, len(hashes), matched.get
        # a touched worker whose bound passes its role's plain best is never walked: left out here
        limit = {False: cost(decode.worker, n, cfg), True: cost(prefill.worker, n, cfg) if prefill.worker else math.inf}
        for w in touched:
            c = by_id.get(w)
            if c is None or w in absent:
                continue
            h = held(w) if w in holders else get(w, 0)
            bound = scale * max(0, n - h) + c.active_blocks
            if w in loaded:
                bound += self.recent.pending(w)[1]
            if bound <= limit[c.role is WorkerRole.PREFILL]:
                bounds.append(Touched(bound, c, h))

        def build(t: Touched) -> Candidate:
            w = t.reported.worker_id
            return self._candidate(t.reported, t.held, host.get(w, 0), disk.get(w, 0))
        priced_decode = walk_touched(bounds, build, n, cfg, model, size, False, limit[False])
        priced_prefill = walk_touched(bounds, build, n, cfg, model, prefill_size, True, limit[True])
        out = priced_decode + priced_prefill + plain
        holding = [w for w in touched if w in by_id and w not in absent and held(w)]
        if cfg.kv_fetch and holding:  # the best holder, for the cluster KV tier, though too busy to be chosen
            best = max(holding, key=held)
            if all(c.worker_id != best for c in out):
                out.append(priced(by_id[best]))
        return out

    def _avoiding(self, pool: list[Candidate], avoid: list[str]) -> list[Candidate]:
        """``pool`` without the suspects the caller asked to avoid, role by role (prefill,
        decode, both: a role's workers are a cluster of their own, as Envoy counts ejection
        per cluster): at most ``max_ejection_share`` of a role, and none of it when fewer than
        ``panic_threshold`` of it would remain (then every worker of the role is a candidate
        again: panic mode). A mesh's only decode worker is never avoided for its prefill
        workers' number."""
        if not avoid:
            return pool
        order = {a: k for k, a in enumerate(dict.fromkeys(avoid))}
        members: Counter[WorkerRole] = Counter(c.role for c in pool)
        suspects: dict[WorkerRole, list[str]] = {}
        for c in pool:
            if c.address in order:
                suspects.setdefault(c.role, []).append(c.address)
        avoided: set[str] = set()
        for role, addresses in suspects.items():
            cut = sorted(addresses, key=order.__getitem__)[:int(self.max_ejection_share * members[role])]
            if members[role] - len(cut) < self.panic_threshold * members[role]:
                metrics.PANICS.inc()
                continue
            avoided.update(cut)
        return [c for c in pool if c.address not in avoided] if avoided else pool

    async def _registry_view(self, request: scheduler_pb2.PlaceRequest, timeout: float | None
                             ) -> tuple[View, kv_registry_pb2.MatchResponse]:
        """Live workers and prefix overlap. While the registry (or its Redis) is down or
        slow (no answer within ``registry_timeout_s``), the last live set seen within
        ``stale_workers_s`` serves, placement on load alone."""
        timeout = self.registry_timeout_s if timeout is None else min(timeout, self.registry_timeout_s)
        try:
            workers, match = await asyncio.gather(
                self._live_workers(timeout),
                self.registry.Match(kv_registry_pb2.MatchRequest(block_hashes=request.block_hashes), timeout=timeout))
        except grpc.aio.AioRpcError as err:
            seen, at = self._last_view
            if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or \
                    time.monotonic() - at > self.stale_workers_s:
                raise Unavailable(f"kv-registry unavailable: {err.details()}") from None
            log.warning("kv-registry unavailable (%s): placing on the last known workers, by load", err.details())
            return seen, kv_registry_pb2.MatchResponse(unknown_workers=list(seen.by_id))
        return workers, match

    async def _live_workers(self, timeout: float) -> View:
        """The live set: the watch's view while it is current. Else a listing younger than
        ``workers_cache_s`` as it is; an older one starts a new listing, and while that runs
        a placement takes the old one if it is no older than twice a listing's own time past
        the window (a large mesh's listing takes tens of ms: placements then never wait for
        one while they keep coming, and a live set is never staler than about three
        listings); else it waits for the new one. ``workers_cache_s`` 0: every placement
        waits for a listing of its own."""
        if self.watch is not None:
            view = await self.watch.current(timeout)
            if view is not None:
                self._last_view = (view, self.watch.heard_at)
                return view
        last, at = self._last_view
        age = time.monotonic() - at
        if age <= self.workers_cache_s:
            return last
        if self._listing is None:
            self._listing = asyncio.ensure_future(self._list(timeout))
            self._listing.add_done_callback(self._listed)
        if self.workers_cache_s > 0 and age <= self.workers_cache_s + 2 * self._listing_s:
            return last
        return await asyncio.shield(self._listing)  # a caller that gives up does not cancel the others' call

    async def _list(self, timeout: float) -> View:
        started = time.monotonic()
        workers = await self.registry.ListWorkers(kv_registry_pb2.ListWorkersRequest(), timeout=timeout)
        # a large mesh's candidates take ms of Python to make: in a thread, beside the placements
        view = await asyncio.to_thread(listed, workers)
        self._listing_s = time.monotonic() - started
        self._last_view = (view, started)  # as old as the request that fetched it
        return view

    def _listed(self, future: asyncio.Future) -> None:
        self._listing = None
        if not future.cancelled():
            future.exception()  # retrieved: the callers that awaited it have it

    async def GetMeshConfig(self, request, context) -> scheduler_pb2.SchedulerServiceGetMeshConfigResponse:
        """The registry's answer, asked once: it never changes while the registry runs
        (a registry restarted with another block size refuses every worker registered
        with the old one, and the mesh is restarted with it)."""
        if self._mesh_config is None:
            try:
                answer = await self.registry.GetMeshConfig(kv_registry_pb2.GetMeshConfigRequest(),
                                                           timeout=self.registry_timeout_s)
            except grpc.aio.AioRpcError as err:
                raise Unavailable(f"kv-registry unavailable: {err.details()}") from None
            self._mesh_config = answer.config
        return scheduler_pb2.SchedulerServiceGetMeshConfigResponse(config=self._mesh_config)

    async def GetStats(self, request: scheduler_pb2.GetStatsRequest, context) -> scheduler_pb2.GetStatsResponse:
        return scheduler_pb2.GetStatsResponse(placements=self.placements, by_prefill_reason=dict(self.by_reason),
                                              by_policy_branch=dict(self.by_branch),
                                              by_worker=dict(self.by_worker), refused=self.refused)

    def _candidate(self, reported: Candidate, matched_blocks: int, host_blocks: int = 0,
                   disk_blocks: int = 0) -> Candidate:
        # placements since its last report count as its load until the report shows them
        prefill_tokens, blocks = self.recent.pending(reported.worker_id)
        sent = self.recent.sent_blocks(reported.worker_id) if self.config.new_prefix == "content" else 0
        if not (matched_blocks or prefill_tokens or blocks or sent):
            return reported
        return replace(reported, matched_blocks=matched_blocks, host_blocks=host_blocks, disk_blocks=disk_blocks,
                       active_blocks=reported.active_blocks + blocks,
                       prefill_tokens=reported.prefill_tokens + prefill_tokens,
                       free_blocks=reported.free_blocks - blocks, sent_blocks=sent)


def _kv_source(decision: Decision) -> common_pb2.KvSource | None:
    fetch = decision.fetch
    if fetch is None:
        return None
    return common_pb2.KvSource(address=fetch.holder.address, first_block=fetch.first_block,
                               num_blocks=fetch.num_blocks)
