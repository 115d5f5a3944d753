"""How one request is sent and timed.

Each request records when it was sent, its time to first token, the gap before each
later chunk of tokens (one gap per chunk, however many tokens it carries, as ``vllm
bench serve`` records it: a chunk of k tokens is one wait for the client), when its
last token came (end-to-end latency runs to it, not to the stream's end), its token
counts and, if it failed, the status (a gRPC code name, or an HTTP status). A failed
request's timings are not used."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from control_plane.cli.client import ROUTER_SERVICE, build_request
from services.common import replicas
from services.common.security import PLAINTEXT, MeshSecurity
from services.proto import router_pb2_grpc

from .workload import BenchRequest


@dataclass
class Timed:
    ttft: float = 0.0  # seconds
    itls: list[float] = field(default_factory=list)  # seconds, one per chunk after the first token's
    tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    started: float = 0.0  # perf_counter
    ended: float = 0.0  # when the stream ended
    error: str | None = None
    last_token: float | None = None  # perf_counter when the last token came; None: not recorded, ``ended``

    @property
    def e2e(self) -> float:
        """From sending to the last token (vLLM's E2EL)."""
        return (self.ended if self.last_token is None else self.last_token) - self.started

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT)."""
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None

    def token_arrived(self, count: int) -> None:
        now = time.perf_counter()
        if not self.tokens or self.last_token is None:
            self.ttft = now - self.started
        else:
            self.itls.append(now - self.last_token)
        self.tokens += count
        self.last_token = now


class KervanBackend:
    """A Kervan router's gRPC ``Generate``: token ids as they are, greedy, ``ignore_eos``
    so every request generates exactly its ``max_tokens``. ``address`` may list several
    routers (comma-separated), balanced as ``kervan generate`` balances them."""

    name = "kervan"

    def __init__(self, address: str, security: MeshSecurity = PLAINTEXT, api_key: str | None = None,
                 timeout_s: float = 600.0):
        self.address, self.security, self.timeout_s = address, security, timeout_s
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
        self._channel: grpc.aio.Channel | None = None

    async def __aenter__(self) -> KervanBackend:
        self._channel = self.security.channel(replicas.target(self.address), replicas.options(ROUTER_SERVICE))
        self.stub = router_pb2_grpc.RouterServiceStub(self._channel)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def send(self, req: BenchRequest) -> Timed:
        out = Timed(started=time.perf_counter())
        kind = {"token_ids": req.prompt} if isinstance(req.prompt, list) else {"prompt": req.prompt}
        request = build_request(**kind, max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        try:
            async for msg in self.stub.Generate(request, timeout=self.timeout_s, metadata=self.metadata):
                if msg.WhichOneof("kind") == "finished":
                    out.prompt_tokens = msg.finished.usage.prompt_tokens
                    out.cached_prompt_tokens = msg.finished.usage.cached_prompt_tokens
                elif msg.delta.token_ids:
                    out.token_arrived(len(msg.delta.token_ids))
        except grpc.aio.AioRpcError as exc:
            out.error = exc.code().name
        out.ended = time.perf_counter()
        return out


class OpenAIBackend:
    """Any OpenAI-compatible server's streamed ``/v1/completions`` (Kervan's HTTP front,
    vLLM, SGLang), through the ``openai`` client. Token-id prompts are sent as a list of
    ids; ``ignore_eos`` is asked for as vLLM and Kervan take it (an extra body field)."""

    name = "openai"

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout_s: float = 600.0):
        try:
            import openai
        except ImportError:
            raise RuntimeError("the openai backend needs the openai client: pip install openai") from None
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key or "none", timeout=timeout_s,
                                         max_retries=0)
        self.model, self.openai = model, openai

    async def __aenter__(self) -> OpenAIBackend:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()

    async def send(self, req: BenchRequest) -> Timed:
        out = Timed(started=time.perf_counter())
        completion_tokens = 0
        try:
            stream = await self.client.completions.create(
                model=self.model, prompt=req.prompt, max_tokens=req.max_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.usage is not None:
                    completion_tokens = chunk.usage.completion_tokens
                    out.prompt_tokens = chunk.usage.prompt_tokens
                    details = getattr(chunk.usage, "prompt_tokens_details", None)
                    out.cached_prompt_tokens = getattr(details, "cached_tokens", 0) or 0
                if chunk.choices:  # a chunk's token count is not in the stream: one per chunk
                    out.token_arrived(1)
            if out.tokens and completion_tokens != out.tokens:  # the usage counts them
                out.tokens = completion_tokens
        except self.openai.APIStatusError as exc:
            out.error = f"HTTP {exc.status_code}"
        except self.openai.APIError as exc:
            out.error = type(exc).__name__
        out.ended = time.perf_counter()
        return out
