"""The benchmarks' client side: stream requests through a router, timing each token.

Each request records its time to first token, inter-token latencies (a chunk of
k tokens counts k times, at its mean gap) and its usage; ``run_closed_loop`` keeps
``concurrency`` requests in flight until a bounded list is done."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from control_plane.client import build_request
from services.common.security import PLAINTEXT, MeshSecurity
from services.proto import router_pb2_grpc


@dataclass
class Timed:
    ttft: float = 0.0  # seconds
    itls: list[float] = field(default_factory=list)  # seconds, one per token after the first
    tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    started: float = 0.0
    ended: float = 0.0


async def timed_request(stub: router_pb2_grpc.RouterServiceStub, prompt: list[int], max_tokens: int,
                        timeout: float = 600) -> Timed:
    out = Timed(started=time.perf_counter())
    last = out.started
    async for msg in stub.Generate(build_request(token_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                                 ignore_eos=True), timeout=timeout):
        if msg.WhichOneof("kind") == "finished":
            out.prompt_tokens = msg.finished.usage.prompt_tokens
            out.cached_prompt_tokens = msg.finished.usage.cached_prompt_tokens
            continue
        new = len(msg.delta.token_ids)
        if not new:
            continue
        now = time.perf_counter()
        if not out.tokens:
            out.ttft = now - out.started
        else:
            out.itls += [(now - last) / new] * new
        out.tokens += new
        last = now
    out.ended = time.perf_counter()
    return out


async def run_closed_loop(address: str, work: list[tuple[list[int], int]], concurrency: int,
                          warm_up: bool = True, security: MeshSecurity = PLAINTEXT) -> tuple[list[Timed], float]:
    """Every (prompt, max_tokens) of ``work`` in order, ``concurrency`` at a time;
    returns the results in ``work``'s order and the wall time."""
    sem = asyncio.Semaphore(concurrency)
    async with security.channel(address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        if warm_up:
            await timed_request(stub, [5] * 8, 2)  # connections, first-call costs

        async def one(prompt, n):
            async with sem:
                return await timed_request(stub, prompt, n)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p, n) for p, n in work))
        return list(results), time.perf_counter() - t0


def pct_ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q / 100 * len(values)))] * 1000, 2)
