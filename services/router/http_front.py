"""The router's OpenAI-compatible HTTP front (``--http-port``), on Starlette and uvicorn
in the router's own event loop.

- ``POST /v1/completions`` and ``POST /v1/chat/completions``: JSON, or server-sent
  events with ``"stream": true`` (one ``data:`` line per chunk, ``data: [DONE]`` at
  the end, a last chunk with the usage when ``stream_options.include_usage``);
- ``GET /v1/models``: the served model; ``GET /health``: 200 while the router serves;
- ``GET /`` and ``GET /mesh``: a chat page and the live mesh's page (``web_pages.py``), and
  ``GET /mesh/state``, the mesh page's JSON (``mesh_view.py``).

Each prompt is a ``RouterCore.generate`` in the router's own process (``core.py``, what its
gRPC ``Generate`` calls too), so the HTTP front has the gRPC path's validation, admission,
placement and migration; the status each refusal or failure would have over gRPC becomes
an HTTP one (INVALID_ARGUMENT 400, NOT_FOUND 404, ALREADY_EXISTS 409, RESOURCE_EXHAUSTED 429,
UNAVAILABLE 503, DEADLINE_EXCEEDED 504, anything else 500) in OpenAI's error body. A
streaming client that disconnects closes its streams, which aborts the request on the
workers and frees its KV.

With API keys, every route but ``/health`` needs ``Authorization: Bearer <key>``
(401 before the body is read); the key it matched is the request's tenant. A body's prompts are
bounded (``RequestBounds``: 400) and must all fit the router's slots, shared with its gRPC
clients and per key (``admission.py``), before any starts (429 with ``Retry-After``). Slow
and many connections are bounded too (``http_guard.py``: header and body deadlines, caps on
connections in all and per client address). A body is read
only up to ``max_body_bytes`` (the router's ``--max-request-bytes``): a longer one, by
its ``Content-Length`` or as it streams in, gets 413 and is not read further. With TLS the
front serves HTTPS with the router's certificate."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from kervan.chat_template import ChatTemplate
from kervan.envs import listen_reuseport
from kervan.sampling import InvalidRequest
from kervan.tokenizer import Tokenizer
from services.common.auth import ApiKeys
from services.common.convert import finish_from_proto
from services.common.errors import Overloaded, status_for
from services.proto import router_pb2
from services.router.admission import RETRY_AFTER_S
from services.router.core import MeshFailure, RouterCore
from services.router.http_guard import (
    DEFAULT_LIMITS,
    ConnectionCounts,
    HttpLimits,
    guarded_protocol,
    raise_open_files_limit,
    within_open_files,
)
from services.router.mesh_view import MeshView
from services.router.openai_protocol import (
    DEFAULT_BOUNDS,
    Choice,
    OpenAIRequest,
    RequestBounds,
    chat_logprobs,
    completion_logprobs,
    parse_chat,
    parse_completion,
    usage,
)
from services.router.web_pages import chat_page, mesh_page

log = logging.getLogger(__name__)
HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
               grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.NOT_FOUND: 404,
               grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
               grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
               grpc.StatusCode.CANCELLED: 503}  # cancelled by the router (stopping, overloaded): retry
# bodies past this size are parsed off the event loop, which keeps answering /health meanwhile
THREAD_PARSE_BYTES = 64 << 10


def error_response(status: int, message: str, code: str, retry_after_s: float | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 and status != 429 else (
        "rate_limit_error" if status == 429 else "server_error")
    headers = None if retry_after_s is None else {"Retry-After": str(max(1, round(retry_after_s)))}
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status,
                        headers=headers)


def failure_response(exc: Exception) -> JSONResponse:
    """What a refused or failed ``RouterCore.generate`` answers, with the status gRPC would give."""
    code = exc.code if isinstance(exc, MeshFailure) else status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("an HTTP request failed inside the router", exc_info=exc)
    retry = exc.retry_after_s if isinstance(exc, Overloaded) else None
    return error_response(HTTP_STATUS.get(code, 500), str(exc) or code.name, code.name.lower(), retry)


class OpenAIFront:
    """The HTTP front of the router whose core is ``core``."""

    def __init__(self, core: RouterCore, model_name: str, tokenizer: Tokenizer | None,
                 chat_template: ChatTemplate, api_keys: ApiKeys | None = None,
                 max_body_bytes: int = 4 << 20, bounds: RequestBounds = DEFAULT_BOUNDS,
                 http_limits: HttpLimits = DEFAULT_LIMITS, mesh_view: MeshView | None = None):
        self.core = core
        self.mesh_view = mesh_view or MeshView(model_name, core.runner.journal)
        self.max_body_bytes = max_body_bytes
        self.bounds = bounds
        self.http_limits = http_limits
        self.connections: ConnectionCounts | None = None
        self.api_keys = api_keys
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/", chat_page, methods=["GET"]),
            Route("/mesh", mesh_page, methods=["GET"]),
            Route("/mesh/state", self.mesh_state, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ])
        self.server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self, host: str, port: int, grace_s: float = 5.0, tls_cert: str | None = None,
                    tls_key: str | None = None) -> int:
        """Serve on ``host:port`` (0: a free port), HTTPS when given a certificate and key;
        returns the port. ``stop`` gives the requests in flight ``grace_s`` seconds."""
        self.connections = ConnectionCounts(within_open_files(self.http_limits, raise_open_files_limit()))
        self.server = _Server(uvicorn.Config(self.app, host=host, port=port, log_level="warning", lifespan="off",
                                             access_log=False, timeout_graceful_shutdown=math.ceil(grace_s),
                                             ssl_certfile=tls_cert, ssl_keyfile=tls_key,
                                             http=guarded_protocol(self.connections)))
        # bound here, not by uvicorn: under the launcher, beside its reservation of the port
        self._task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[_listening_socket(host, port)]))
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start (the port is taken...)
            await asyncio.sleep(0.01)
        return self.server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            if self._task is not None:
                await self._task

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    def _refusal(self, request: Request) -> JSONResponse | None:
        if self.api_keys is None:
            return None
        why = self.api_keys.check({"authorization": request.headers.get("authorization", "")})
        return None if why is None else error_response(401, why, "invalid_api_key")

    async def models(self, request: Request) -> JSONResponse:
        if (refused := self._refusal(request)) is not None:
            return refused
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                         "created": self.created, "owned_by": "kervan"}]})

    async def mesh_state(self, request: Request) -> JSONResponse:
        if (refused := self._refusal(request)) is not None:
            return refused
        return JSONResponse(await self.mesh_view.state(len(self.core.in_flight)))

    async def completions(self, request: Request):
        return await self._serve(request, "text_completion",
                                 lambda body: parse_completion(body, self.model_name, self.bounds))

    async def chat_completions(self, request: Request):
        return await self._serve(request, "chat.completion",
                                 lambda body: parse_chat(body, self.model_name, self.chat_template.render, self.bounds))

    async def _bounded_body(self, request: Request) -> bytes | None:
        """The body, or None once it proves longer than ``max_body_bytes`` (the rest unread)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return None
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    return None
                chunks.append(chunk)
        except ClientDisconnect:  # gone, or closed for sending its body too slowly (http_guard.py)
            return None
        return b"".join(chunks)

    async def _serve(self, request: Request, kind: str, parse):
        if (refused := self._refusal(request)) is not None:
            return refused
        raw = await self._bounded_body(request)
        if raw is None:
            return error_response(413, f"the body is larger than {self.max_body_bytes} bytes", "request_too_large")
        try:
            body = json.loads(raw) if len(raw) < THREAD_PARSE_BYTES else await asyncio.to_thread(json.loads, raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(400, f"the body is not JSON: {exc}", "invalid_argument")
        except RecursionError:
            return error_response(400, "the body is not JSON this server reads: nested too deeply", "invalid_argument")
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object", "invalid_argument")
        try:
            parsed = parse(body)
        except InvalidRequest as exc:
            return error_response(400, str(exc), "invalid_argument")
        key = self.api_keys.identity(request.headers) if self.api_keys is not None else ""
        if (why := self.core.admission.refusal(key, len(parsed.prompts))) is not None:
            return error_response(429, why, "resource_exhausted", RETRY_AFTER_S)
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        rid = f"{prefix}-{uuid.uuid4().hex}"
        streams = [self.core.generate(_with_id(p, f"{rid}-{i}" if len(parsed.prompts) > 1 else rid), key)
                   for i, p in enumerate(parsed.prompts)]
        events = _merged(streams)
        try:
            first = await anext(events)  # the router's refusal, if any, is still an HTTP status
        except Exception as exc:  # noqa: BLE001 (a refusal or failure: its kind picks the status)
            await events.aclose()
            return failure_response(exc)
        except StopAsyncIteration:
            return error_response(500, "the router answered nothing", "internal")
        answer = _Answer(self, parsed, kind, rid)
        if parsed.stream:
            return StreamingResponse(answer.stream(first, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            answer.take(*first)
            async for prompt_index, response in events:
                answer.take(prompt_index, response)
        except Exception as exc:  # noqa: BLE001 (as above)
            return failure_response(exc)
        finally:
            await events.aclose()
        return JSONResponse(answer.body())


class _Answer:
    """Accumulates one HTTP request's responses into OpenAI's shapes."""

    def __init__(self, front: OpenAIFront, parsed: OpenAIRequest, kind: str, rid: str):
        self.front, self.parsed, self.kind, self.rid = front, parsed, kind, rid
        self.chat = kind == "chat.completion"
        self.choices: dict[int, Choice] = {}
        self.prompt_tokens: dict[int, tuple[int, int]] = {}  # prompt -> (tokens, cached)
        self.completion_tokens = 0

    def take(self, prompt_index: int, response: router_pb2.GenerateResponse) -> dict | None:
        """Add one response; returns the chunk a stream sends for it (None: nothing new)."""
        which = response.WhichOneof("kind")
        if which == "delta":
            d = response.delta
            choice = self._choice(prompt_index, d.sample_index)
            choice.text += d.text
            choice.token_ids += d.token_ids
            choice.logprobs += d.logprobs
            return self._chunk(choice.index, d.text, list(d.token_ids), list(d.logprobs), None)
        if which == "finished":
            f = response.finished
            choice = self._choice(prompt_index, f.sample_index)
            choice.finish_reason = finish_from_proto(f.finish_reason) or "stop"
            self.prompt_tokens[prompt_index] = (f.usage.prompt_tokens, f.usage.cached_prompt_tokens)
            self.completion_tokens += f.usage.completion_tokens
            return self._chunk(choice.index, "", [], [], choice.finish_reason)
        return None

    def body(self) -> dict:
        choices = []
        for index in sorted(self.choices):
            c = self.choices[index]
            logprobs = self._logprobs(c.token_ids, c.logprobs)
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": logprobs, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": index, "text": c.text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason})
        return {**self._head(self.kind), "choices": choices, "usage": self._usage()}

    async def stream(self, first, events: AsyncGenerator) -> AsyncIterator[str]:
        try:
            if self.chat:  # the role first, as OpenAI streams it
                for i in range(len(self.parsed.prompts) * self.parsed.n):
                    yield _sse({**self._head("chat.completion.chunk"), "choices": [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]})
            chunk = self.take(*first)
            if chunk:
                yield _sse(chunk)
            try:
                async for prompt_index, response in events:
                    chunk = self.take(prompt_index, response)
                    if chunk:
                        yield _sse(chunk)
            except Exception as exc:  # noqa: BLE001 (after the first chunk the status is sent: say it in it)
                yield _sse(json.loads(bytes(failure_response(exc).body)))
                return
            if self.parsed.include_usage:
                yield _sse({**self._head(self.kind + ("" if not self.chat else ".chunk")), "choices": [],
                            "usage": self._usage()})
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away: cancelling the calls aborts the request on the workers
            await events.aclose()

    def _choice(self, prompt_index: int, sample_index: int) -> Choice:
        index = prompt_index * self.parsed.n + sample_index
        return self.choices.setdefault(index, Choice(index))

    def _chunk(self, index: int, text: str, token_ids: list[int], logprobs: list[float],
               finish_reason: str | None) -> dict:
        lp = self._logprobs(token_ids, logprobs) if token_ids else None
        if self.chat:
            delta = {"content": text} if finish_reason is None else {}
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        return {**self._head("text_completion"),
                "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}]}

    def _logprobs(self, token_ids: list[int], logprobs: list[float]) -> dict | None:
        if not self.parsed.logprobs:
            return None
        tok = self.front.tokenizer
        tokens = [tok.decode([t]) if tok else str(t) for t in token_ids]
        return chat_logprobs(tokens, logprobs) if self.chat else completion_logprobs(tokens, logprobs)

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": int(time.time()), "model": self.parsed.model}

    def _usage(self) -> dict:
        return usage(sum(t for t, _ in self.prompt_tokens.values()), sum(c for _, c in self.prompt_tokens.values()),
                     self.completion_tokens)


def _with_id(request: router_pb2.GenerateRequest, rid: str) -> router_pb2.GenerateRequest:
    out = router_pb2.GenerateRequest()
    out.CopyFrom(request)
    out.request_id = rid
    return out


async def _merged(streams: list[AsyncIterator[router_pb2.GenerateResponse]]
                  ) -> AsyncGenerator[tuple[int, router_pb2.GenerateResponse], None]:
    """(prompt index, response) from every stream, as they come; closing it closes them all
    (each one's request aborted on the workers, its slot given back)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[router_pb2.GenerateResponse]) -> None:
        try:
            async for response in stream:
                await queue.put((index, response))
            await queue.put((index, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (the consumer raises it, and answers by its kind)
            await queue.put((index, exc))

    tasks = [asyncio.get_running_loop().create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, reuse_port=listen_reuseport())


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Server(uvicorn.Server):
    """uvicorn in a loop it does not own: the router's own handlers take SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield
