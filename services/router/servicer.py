"""RouterService: validate and tokenize, forward to workers, stream text back.

Running a request on the workers (placement, migration when a worker is lost)
is ``runner.py``'s. Deadlines are passed on (Python gRPC does not propagate them
by itself); a client that goes away cancels the worker calls, which abort the
request and free its blocks."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass

import grpc

from services.common.convert import sampling_from_proto
from services.common.errors import AlreadyExists, NotFound, Overloaded, retry_after_s
from services.proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2
from services.router.detokenizer import Detokenizer
from services.router.routes import ScheduledRoutes, StaticRoutes
from services.router.runner import MigrationPolicy, RequestRunner
from services.router.stop_strings import StopWatch, validate_stop
from worker.engine.sampling_params import InvalidRequest
from worker.tokenizer import Tokenizer

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    name: str = ""  # the served model's name (its directory's, as workers register it)


class _Deadline:
    """The client's deadline, passed on to every hop as the time then remaining."""

    def __init__(self, context: grpc.aio.ServicerContext):
        remaining = context.time_remaining()
        self.at = None if remaining is None else time.monotonic() + remaining

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())


@dataclass
class _Sample:
    detok: Detokenizer | None
    stop: StopWatch | None = None
    ended: bool = False
    completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, routes: StaticRoutes | ScheduledRoutes, tokenizer: Tokenizer | None, limits: ModelLimits,
                 max_in_flight: int = 1024, migration: MigrationPolicy | None = None):
        self.runner = RequestRunner(routes, limits.name, migration or MigrationPolicy())
        self.max_in_flight = max_in_flight
        self.tokenizer = tokenizer
        self.limits = limits
        self.in_flight: set[str] = set()

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        start = time.perf_counter()
        if request.request_id and not REQUEST_ID.fullmatch(request.request_id):
            raise InvalidRequest(f"request_id must be 1-128 characters of A-Z a-z 0-9 . _ : - "
                                 f"(got {len(request.request_id)} characters)")
        rid = request.request_id or uuid.uuid4().hex
        if request.model and request.model != self.limits.name:
            raise NotFound(f"model {request.model!r} is not served here (this router serves {self.limits.name!r})")
        prompt = self._prompt_ids(request)
        params = sampling_from_proto(request.sampling)
        stop = list(request.sampling.stop)
        validate_stop(stop, self.tokenizer is not None)
        if len(prompt) + params.max_tokens > self.limits.max_model_len:
            raise InvalidRequest(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                 f"the maximum model length {self.limits.max_model_len}")
        if rid in self.in_flight:
            raise AlreadyExists(f"request_id {rid!r} is already in flight")
        if len(self.in_flight) >= self.max_in_flight:
            raise Overloaded(f"the router has {len(self.in_flight)} requests in flight, its limit; retry later")
        self.in_flight.add(rid)
        try:
            samples: dict[int, _Sample] = {}
            cached = ended = 0
            updates = self.runner.run(rid, prompt, request.sampling, params.n, _Deadline(context))
            try:
                async for attempt, update in updates:
                    cached = max(cached, update.cached_prompt_tokens)
                    sample = samples.setdefault(update.sample_index, _Sample(
                        Detokenizer(self.tokenizer) if self.tokenizer else None, StopWatch(stop) if stop else None))
                    if sample.ended:
                        continue  # stopped by a stop string; the worker is still finishing other samples
                    if update.token_ids:
                        delta = self._delta(rid, update, sample, attempt)
                        if sample.stop is not None:
                            delta.delta.text, hit = sample.stop.feed(delta.delta.text, bool(update.finish_reason))
                            if hit:
                                update.finish_reason = common_pb2.FINISH_REASON_STOP
                        yield delta
                    if update.finish_reason:
                        if sample.stop is not None and sample.stop.held:  # ended without new tokens: flush
                            yield router_pb2.GenerateResponse(request_id=rid, delta=router_pb2.TokenDelta(
                                sample_index=update.sample_index, index=sample.completion_tokens,
                                text=sample.stop.feed("", True)[0], attempt=attempt))
                        yield self._finished(rid, update, sample, len(prompt), cached, start)
                        sample.ended = True
                        ended += 1
                        if ended == params.n:
                            break  # closing the updates cancels what the workers still run
            except grpc.aio.AioRpcError as err:  # the scheduler's or a worker's status is the client's answer
                if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise Overloaded(err.details() or "overloaded", retry_after_s(err) or 0.5) from None
                await context.abort(err.code(), err.details() or "worker failed")
            finally:
                await updates.aclose()
        finally:
            self.in_flight.discard(rid)

    def _prompt_ids(self, request: router_pb2.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            try:
                text = request.text.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidRequest(f"prompt.text is not valid UTF-8 (byte {exc.start})") from None
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer: send prompt.token_ids")
            ids = self.tokenizer.encode(text)
        elif kind == "token_ids":
            ids = list(request.token_ids.ids)
            bad = [t for t in ids if t >= self.limits.vocab_size]
            if bad:
                raise InvalidRequest(f"prompt.token_ids {bad[:5]} are outside the vocabulary "
                                     f"[0, {self.limits.vocab_size})")
        else:
            raise InvalidRequest("prompt is missing: set prompt.text or prompt.token_ids")
        if not ids:
            raise InvalidRequest("prompt is empty")
        return ids

    def _delta(self, rid: str, msg: worker_pb2.TokenUpdate, sample: _Sample, attempt: int
               ) -> router_pb2.GenerateResponse:
        now = time.perf_counter()
        sample.first_token_at = sample.first_token_at or now
        sample.last_token_at = now
        sample.completion_tokens += len(msg.token_ids)
        text = sample.detok.add(list(msg.token_ids), final=bool(msg.finish_reason)) if sample.detok else ""
        return router_pb2.GenerateResponse(request_id=rid, delta=router_pb2.TokenDelta(
            sample_index=msg.sample_index, index=msg.index, token_ids=msg.token_ids, text=text,
            logprobs=msg.logprobs, attempt=attempt))

    @staticmethod
    def _finished(rid: str, msg: worker_pb2.TokenUpdate, sample: _Sample, prompt_tokens: int, cached: int,
                  start: float) -> router_pb2.GenerateResponse:
        ttft = (sample.first_token_at - start) if sample.first_token_at else 0.0
        tpot = 0.0
        if sample.completion_tokens > 1:
            tpot = (sample.last_token_at - sample.first_token_at) / (sample.completion_tokens - 1)
        usage = common_pb2.Usage(prompt_tokens=prompt_tokens, cached_prompt_tokens=cached,
                                 completion_tokens=sample.completion_tokens, time_to_first_token_s=ttft,
                                 time_per_output_token_s=tpot)
        return router_pb2.GenerateResponse(request_id=rid, finished=router_pb2.Finished(
            sample_index=msg.sample_index, finish_reason=msg.finish_reason, usage=usage))
