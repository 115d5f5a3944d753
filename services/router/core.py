"""The router's core: validate and tokenize a request, run it on the workers, stream its
text back. The gRPC ``RouterService`` (``servicer.py``) and the OpenAI HTTP front
(``http_front.py``) both call ``RouterCore.generate`` in-process.

Running a request on the workers (placement, migration when a worker is lost)
is ``runner.py``'s; turning each sample's token updates into responses (text, stop
strings, usage) is ``sample_stream.py``'s. Deadlines are passed on (Python gRPC does not propagate them
by itself); a caller that goes away (closing the stream) cancels the worker calls, which abort
the request and free its blocks. A failure of the mesh reaches the client without the
addresses and URLs inside it (``public_message``)."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from kervan.sampling import InvalidRequest, SamplingParams
from kervan.tokenizer import Tokenizer
from services.common.convert import sampling_from_proto
from services.common.errors import AlreadyExists, NotFound, Overloaded, Unavailable, retry_after_s
from services.proto import router_pb2
from services.router import metrics
from services.router.admission import Admission
from services.router.routes import ScheduledRoutes, StaticRoutes
from services.router.runner import MigrationPolicy, RequestRunner
from services.router.sample_stream import SampleStream
from services.router.scrub import public_message
from services.router.stop_strings import validate_stop

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass(frozen=True, kw_only=True)
class ModelLimits:
    """What the router checks itself; the length and n limits are the workers' (the
    scheduler places a request only where they hold it)."""

    vocab_size: int
    name: str = ""  # the served model's name (its directory's, as workers register it)
    max_position_embeddings: int | None = None  # the model's context: no worker serves a longer prompt


log = logging.getLogger(__name__)
MAX_CACHE_SALT = 256


class Deadline:
    """The client's deadline, passed on to every hop as the time then remaining."""

    def __init__(self, remaining_s: float | None = None):
        self.at = None if remaining_s is None else time.monotonic() + remaining_s

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())


class MeshFailure(Exception):
    """A status from the scheduler or a worker that is the client's answer (its message
    scrubbed of the mesh's addresses)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class RouterCore:
    """``salt_per_key``: each API key's prompts are salted apart (the callers pass the key's
    identity, "" without keys), so a tenant never hits, times or counts another's cache."""

    def __init__(self, routes: StaticRoutes | ScheduledRoutes, tokenizer: Tokenizer | None, limits: ModelLimits,
                 admission: Admission, migration: MigrationPolicy | None = None, salt_per_key: bool = False):
        self.runner = RequestRunner(routes, limits.name, migration or MigrationPolicy())
        self.admission = admission
        self.salt_per_key = salt_per_key
        self.tokenizer = tokenizer
        self.limits = limits
        self.in_flight: set[str] = set()

    async def generate(self, request: router_pb2.GenerateRequest, key: str = "",
                       deadline: Deadline | None = None) -> AsyncIterator[router_pb2.GenerateResponse]:
        """The responses to ``request`` from the holder of API key ``key``; raises the domain's
        errors for a request refused, ``MeshFailure`` for the mesh's own answer."""
        start = time.perf_counter()
        rid, prompt, params = self._admit(request, key)
        # the workers know the request by an id this router mints: a client's id is unique on this
        # router only, and another router's client may reuse it (an abort goes to a worker by id)
        internal = uuid.uuid4().hex
        self.in_flight.add(rid)
        metrics.IN_FLIGHT.inc()
        metrics.REQUEST_PROMPT_TOKENS.observe(len(prompt))
        metrics.PROMPT_TOKENS.inc(len(prompt))
        span = trace.get_current_span()  # the gRPC server span (a no-op one without tracing)
        span.set_attributes({"gen_ai.operation.name": "text_completion", "gen_ai.request.model": self.limits.name,
                             "gen_ai.request.max_tokens": params.max_tokens, "gen_ai.request.temperature":
                             params.temperature, "gen_ai.usage.input_tokens": len(prompt), "kervan.request_id": rid,
                             "kervan.internal_request_id": internal, "kervan.n": params.n})
        try:
            streams: dict[int, SampleStream] = {}
            cached = 0  # prompt tokens served from a cache, as the first attempt's worker said
            updates = self.runner.run(internal, prompt, params, deadline or Deadline(),
                                      self._cache_salt(request.cache_salt, key))
            try:
                async for attempt, update in updates:
                    cached = max(cached, update.cached_prompt_tokens)
                    if update.sample_index not in streams:
                        streams[update.sample_index] = SampleStream(rid, update.sample_index, self.tokenizer,
                                                                    list(request.sampling.stop), len(prompt), start)
                    for response in streams[update.sample_index].take(update, attempt, cached):
                        yield response
                    if sum(s.ended for s in streams.values()) == params.n:
                        break  # closing the updates cancels what the workers still run
            except grpc.aio.AioRpcError as err:  # the scheduler's or a worker's status is the client's answer
                if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise Overloaded(err.details() or "overloaded", retry_after_s(err) or 0.5) from None
                raise MeshFailure(err.code(), public_message(err.code(), err.details() or "worker failed")) from None
            except Unavailable as exc:
                raise Unavailable(public_message(grpc.StatusCode.UNAVAILABLE, str(exc))) from None
            except Overloaded as exc:  # a worker's refusal may name it
                raise Overloaded(public_message(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)),
                                 exc.retry_after_s) from None
            finally:
                await updates.aclose()
                span.set_attributes({"gen_ai.usage.output_tokens": sum(x.completion_tokens for x in streams.values()),
                                     "kervan.cached_prompt_tokens": cached})
        finally:
            self.in_flight.discard(rid)
            self.admission.give_back(key)
            metrics.IN_FLIGHT.dec()

    def _cache_salt(self, salt: str, key: str) -> str:
        """With ``salt_per_key``, the caller's key salts its prompts' KV blocks too."""
        return f"{key}:{salt}" if self.salt_per_key else salt

    def _admit(self, request: router_pb2.GenerateRequest, key: str) -> tuple[str, list[int], SamplingParams]:
        """The request id, prompt and sampling of a request this router takes; raises for
        one it refuses (a client mistake, or the router at its in-flight limit)."""
        if request.request_id and not REQUEST_ID.fullmatch(request.request_id):
            raise InvalidRequest(f"request_id must be 1-128 characters of A-Z a-z 0-9 . _ : - "
                                 f"(got {len(request.request_id)} characters)")
        rid = request.request_id or uuid.uuid4().hex
        if len(request.cache_salt) > MAX_CACHE_SALT:
            raise InvalidRequest(f"cache_salt is at most {MAX_CACHE_SALT} characters")
        if request.model and request.model != self.limits.name:
            raise NotFound(f"model {request.model!r} is not served here (this router serves {self.limits.name!r})")
        # the cheap refusals before the prompt is tokenized (up to the message limit, 4 MiB)
        if rid in self.in_flight:
            raise AlreadyExists(f"request_id {rid!r} is already in flight")
        if (why := self.admission.refusal(key)) is not None:
            raise Overloaded(why)
        params = sampling_from_proto(request.sampling)
        validate_stop(list(request.sampling.stop), self.tokenizer is not None)
        prompt = self._prompt_ids(request)
        self.admission.take(key)  # given back when Generate ends, however it ends
        return rid, prompt, params

    def _prompt_ids(self, request: router_pb2.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            try:
                text = request.text.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidRequest(f"prompt.text is not valid UTF-8 (byte {exc.start})") from None
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer: send prompt.token_ids")
            context = self.limits.max_position_embeddings
            if context and len(request.text) > context * self.tokenizer.max_token_bytes:
                raise InvalidRequest(f"prompt.text of {len(request.text)} bytes is more than {context} tokens, "
                                     f"the maximum model length")
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
