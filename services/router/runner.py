"""Running one request on the workers the scheduler chooses, and moving it when a
worker is lost.

An attempt is one placement: ``Execute`` on one worker, or ``Prefill`` on one and
``Decode`` on another. An attempt that fails with the worker unreachable (or
stalls: no token for ``stall_timeout_s``) is
- placed again from scratch when it produced nothing yet (up to MAX_PLACEMENTS),
- migrated when it did: placed again with the prompt plus every token already
  delivered as its prompt and the remaining budget, its tokens re-indexed so the
  client sees one contiguous stream (up to ``max_migrations``).
Greedy and unseeded sampling migrate (greedy continues exactly as it would have;
an unseeded sample stays a valid sample); seeded sampling (temperature left unset
is 1.0: sampling) and n > 1 do not (their continuation could not equal the
fault-free one): they end UNAVAILABLE, saying so. A worker that fails the call
(INTERNAL) counts as lost, as does one that gives no first token within
``first_token_timeout_s`` (a wedged prefill). A prefill worker whose push to the
decode worker failed (ABORTED) is not the one lost: the decode worker is, unless it still
answers the router — then the link between the two failed (a partition between their hosts),
and the prefill worker is the one left out, so the decode worker prefills itself.
Later attempts run under ids a client cannot send (``{rid}~m{n}``).

Addresses found unreachable are excluded from this request's placements and, for
``suspect_s``, avoided for everyone's (the registry only notices a dead worker when
its heartbeat lease expires) within the scheduler's ejection cap and panic
threshold: a slow period that marks every worker suspect must not empty the mesh.

A worker that refuses a request at admission (RESOURCE_EXHAUSTED: the
scheduler's view of its load lags its reports) is excluded from that request
alone, which is placed again; when no other worker has room, or after
MAX_PLACEMENTS, the client gets the refusal with its RetryInfo."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from kervan.sampling import FORKED_SAMPLES, SamplingParams
from services.common.convert import sampling_to_proto
from services.common.errors import Overloaded, Unavailable, retry_after_s
from services.proto import common_pb2, worker_pb2, worker_pb2_grpc
from services.router import metrics
from services.router.mesh_journal import MeshJournal
from services.router.routes import ScheduledRoutes, StaticRoutes

log = logging.getLogger(__name__)
MAX_PLACEMENTS = 3
# the worker went away (or drained us out), or failed the call itself
LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL)


@dataclass(frozen=True, kw_only=True)
class MigrationPolicy:
    max_migrations: int = 2  # 0: a lost worker ends the request UNAVAILABLE
    stall_timeout_s: float = 30.0  # no token for this long after the first: the worker is lost
    first_token_timeout_s: float = 120.0  # no first token for this long (queue and prefill): the worker is lost
    suspect_s: float = 10.0


class WorkerLost(Exception):
    def __init__(self, address: str, why: str):
        super().__init__(f"worker {address or '?'} lost: {why}")
        self.address = address
        self.why = why


class WorkerBusy(Exception):
    """The worker refused the request at admission; another may have room."""

    def __init__(self, address: str, err: grpc.aio.AioRpcError):
        super().__init__(err.details() or "a worker is at its request limit")
        self.address = address
        self.retry_after_s = retry_after_s(err) or 0.5


def worker_error(address: str, err: grpc.aio.AioRpcError) -> Exception:
    """What a worker's failed call means to the runner: lost, busy, or the client's answer."""
    if err.code() in LOST:
        return WorkerLost(address, err.details() or err.code().name)
    if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return WorkerBusy(address, err)
    return err


def not_migratable(params: SamplingParams) -> str | None:
    if params.n > 1:
        return f"{FORKED_SAMPLES}; it is not migrated"
    if params.seed is not None and params.temperature != 0:
        return "seeded sampling is not migrated (the continuation would differ from an unbroken run)"
    return None


class Suspects:
    """Addresses recently found unreachable."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._until: dict[str, float] = {}

    def mark(self, address: str) -> None:
        if address:
            self._until[address] = time.monotonic() + self.ttl_s

    def current(self) -> list[str]:
        """Most recently marked first."""
        now = time.monotonic()
        self._until = {a: t for a, t in self._until.items() if t > now}
        return sorted(self._until, key=self._until.__getitem__, reverse=True)


async def answers(worker: worker_pb2_grpc.WorkerServiceStub, timeout_s: float = 1.0) -> bool:
    """Whether a worker answers this router now (its load, within ``timeout_s``)."""
    try:
        await worker.GetLoad(worker_pb2.GetLoadRequest(), timeout=timeout_s)
        return True
    except grpc.aio.AioRpcError:
        return False


@dataclass
class _Progress:
    """Where one request stands across its attempts."""

    delivered: list[int] = field(default_factory=list)  # sample 0's tokens the client has
    excluded: set[str] = field(default_factory=set)  # workers this request found lost or busy
    busy: WorkerBusy | None = None  # the last refusal, answered if no other worker takes the request
    attempt: int = 0  # migrations so far (what TokenDelta.attempt says)
    placements: int = 0  # placements that ended before a first token (lost or refused)


class RequestRunner:
    def __init__(self, routes: StaticRoutes | ScheduledRoutes, model: str, policy: MigrationPolicy):
        self.routes = routes
        self.model = model
        self.policy = policy
        self.suspects = Suspects(policy.suspect_s)
        self.journal = MeshJournal()
        self._background: set[asyncio.Task] = set()

    async def run(self, rid: str, prompt: list[int], params: SamplingParams, deadline,
                  cache_salt: str = "") -> AsyncGenerator[tuple[int, worker_pb2.TokenUpdate], None]:
        """(attempt, update) pairs; updates of later attempts carry indices continuing
        the earlier ones and no cached-prompt count (theirs covers delivered tokens)."""
        state = _Progress()
        while True:
            produced = False
            base = len(state.delivered)  # tokens this attempt's worker counts as prompt
            resumed = dataclasses.replace(params, max_tokens=params.max_tokens - base)
            worker_rid = rid if state.attempt == 0 else f"{rid}~m{state.attempt}"  # "~": never in a client's id
            try:
                async for update in self._attempt(worker_rid, prompt + state.delivered, resumed, deadline,
                                                  state.excluded, cache_salt):
                    produced = True
                    if state.attempt:
                        update.index += base
                        update.cached_prompt_tokens = 0
                    if update.sample_index == 0:
                        state.delivered += update.token_ids
                    yield state.attempt, update
                return
            except WorkerBusy as refused:
                self._refused(rid, state, refused, produced)
            except grpc.aio.AioRpcError as err:
                if state.busy is not None and err.code() == grpc.StatusCode.UNAVAILABLE:
                    raise Overloaded(str(state.busy), state.busy.retry_after_s) from None  # no other worker to try
                raise
            except WorkerLost as lost:
                await self._lost(rid, state, lost, produced, params)

    def _refused(self, rid: str, state: _Progress, refused: WorkerBusy, produced: bool) -> None:
        """Place a refused request elsewhere, or raise the refusal as the client's answer."""
        state.placements += 1
        if produced or state.delivered or state.placements >= MAX_PLACEMENTS or not self.routes.alternatives:
            raise Overloaded(str(refused), refused.retry_after_s) from None
        state.busy = refused
        state.excluded.add(refused.address)
        log.debug("request %s: %s refused it; placing again", rid, refused.address)

    async def _lost(self, rid: str, state: _Progress, lost: WorkerLost, produced: bool,
                    params: SamplingParams) -> None:
        """Place again (nothing delivered yet) or migrate (tokens delivered) a request whose
        worker was lost, or raise UNAVAILABLE saying why it cannot go on."""
        state.excluded.add(lost.address)
        self.suspects.mark(lost.address)
        if not produced and not state.delivered:
            state.placements += 1
            if state.placements >= MAX_PLACEMENTS:
                raise Unavailable(f"{lost}; no other worker took the request") from None
            log.info("request %s: %s before its first token; placing again", rid, lost)
            await asyncio.sleep(0.05 * state.placements)
            return
        reason = not_migratable(params)
        if reason or state.attempt >= self.policy.max_migrations:
            why = reason or f"migration limit ({self.policy.max_migrations}) reached"
            raise Unavailable(f"{lost} after {len(state.delivered)} tokens; {why}") from None
        state.attempt += 1
        metrics.MIGRATIONS.inc()
        self.journal.migrated(rid, lost.address, lost.why, len(state.delivered))
        trace.get_current_span().add_event("kervan.migration", {"kervan.attempt": state.attempt,
                                                                "kervan.lost_worker": lost.address,
                                                                "kervan.delivered_tokens": len(state.delivered)})
        log.info("request %s: %s after %d tokens; migrating (attempt %d)", rid, lost, len(state.delivered),
                 state.attempt)

    async def _attempt(self, rid: str, prompt: list[int], params: SamplingParams, deadline, exclude: set[str],
                       salt: str) -> AsyncIterator[worker_pb2.TokenUpdate]:
        place = await self.routes.route(rid, prompt, params.max_tokens, params.n, deadline.remaining(), self.model,
                                        sorted(exclude), self.suspects.current(), salt)
        self.journal.placed(rid, place.worker_address, place.prefill_address, place.decode_address, place.reason)
        sampling = sampling_to_proto(params)
        ids = common_pb2.TokenIds(ids=prompt)
        if place.worker is not None:
            call = place.worker.Execute(worker_pb2.ExecuteRequest(request_id=rid, prompt=ids, sampling=sampling,
                                                                  cache_salt=salt, kv_source=place.kv_source),
                                        timeout=deadline.remaining())
            async for msg in self._stream(call, place.worker_address):
                yield msg.update
            return
        assert place.prefill is not None and place.decode is not None  # a placement is one worker, or both
        prefill, decode = place.prefill, place.decode
        remaining = deadline.remaining()
        cap = self.policy.first_token_timeout_s
        try:
            first = await prefill.Prefill(worker_pb2.PrefillRequest(
                request_id=rid, prompt=ids, sampling=sampling, decode_address=place.decode_address, cache_salt=salt,
                kv_source=place.kv_source),
                timeout=cap if remaining is None else min(remaining, cap))
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and (remaining is None or remaining > cap):
                raise WorkerLost(place.prefill_address, f"no first token within {cap:g} s") from None
            if err.code() == grpc.StatusCode.ABORTED:  # the prefill worker could not reach the decode worker
                if await answers(decode):
                    raise WorkerLost(place.prefill_address, f"{err.details() or 'KV push failed'} (the decode "
                                                            "worker answers the router: the link between them "
                                                            "failed)") from None
                raise WorkerLost(place.decode_address, err.details() or "KV push failed") from None
            raise worker_error(place.prefill_address, err) from None
        yield worker_pb2.TokenUpdate(index=0, token_ids=[first.first_token],
                                     logprobs=[first.first_logprob] if params.logprobs else [],
                                     finish_reason=first.finish_reason, cached_prompt_tokens=first.cached_prompt_tokens)
        if first.finish_reason:
            return
        call = decode.Decode(worker_pb2.DecodeRequest(
            request_id=rid, prompt=ids, sampling=sampling, first_token=first.first_token,
            first_logprob=first.first_logprob, kv_handle=first.kv_handle, cache_salt=salt),
            timeout=deadline.remaining())
        try:
            async for msg in self._stream(call, place.decode_address):
                yield msg.update
        except asyncio.CancelledError:
            # the client left between handoff and decode: drop the staged KV now, not at lease end
            task = asyncio.ensure_future(  # a gRPC call is awaitable, not a coroutine: create_task refuses it
                decode.Abort(worker_pb2.AbortRequest(request_id=rid), timeout=5))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            raise

    async def _stream(self, call, address: str):
        """The call's messages; a lost worker or a stall raises WorkerLost. The call is
        cancelled whenever this ends early (migration, client gone, error). The stall
        watchdog is one timer re-armed per message (cheaper than a timeout per read)."""
        loop = asyncio.get_running_loop()
        stalled = False
        waited = self.policy.first_token_timeout_s

        def on_stall() -> None:
            nonlocal stalled
            stalled = True
            call.cancel()

        watchdog = loop.call_later(waited, on_stall)  # until the first token: queue and prefill
        try:
            async for msg in call:
                watchdog.cancel()
                yield msg
                waited = self.policy.stall_timeout_s
                watchdog = loop.call_later(waited, on_stall)
        except grpc.aio.AioRpcError as err:
            raise worker_error(address, err) from None
        except asyncio.CancelledError:
            if stalled:
                raise WorkerLost(address, f"no token for {waited:g} s") from None
            raise
        finally:
            watchdog.cancel()
            call.cancel()
