"""When a benchmark sends its requests.

- Open loop (``rate``): arrivals form a Poisson process of ``rate`` requests per
  second (exponential gaps from a seeded generator, scaled so that the N-th request
  arrives at N / rate, as ``vllm bench serve`` scales them: every run's mean rate is
  the one asked for; ``inf`` sends them all at once),
  independent of how fast the server answers: a server that falls behind builds a
  queue and its latencies show it, as a real one's would. ``max_concurrency`` caps
  the requests in flight (arrivals wait for a slot), as ``vllm bench serve`` does.
- Closed loop (``concurrency``): N requests in flight, each sent when one finishes.

Every request list is bounded; the progress bar (tqdm) goes to stderr."""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time

from .backends import Timed
from .workload import BenchRequest


async def run_open_loop(backend, requests: list[BenchRequest], rate: float, seed: int = 0,
                        max_concurrency: int | None = None, progress: bool = True) -> tuple[list[Timed], float]:
    """Every request, arriving at ``rate`` per second; results in ``requests``' order and
    the wall time from the start (the first request arrives one gap after it, as in
    ``vllm bench serve``) to the last answer."""
    offsets = arrival_offsets(len(requests), rate, seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = _bar(len(requests), progress, f"rate {rate:g}/s")

    async def one(req: BenchRequest) -> Timed:
        if gate is None:
            out = await backend.send(req)
        else:
            async with gate:
                out = await backend.send(req)
        bar.update(1)
        return out

    tasks = []
    start = time.perf_counter()
    for req, offset in zip(requests, offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:  # behind schedule (a busy loop): send at once, the schedule does not slip
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    results = await asyncio.gather(*tasks)
    bar.close()
    return list(results), time.perf_counter() - start


async def run_closed_loop(backend, requests: list[BenchRequest], concurrency: int,
                          progress: bool = True) -> tuple[list[Timed], float]:
    """``concurrency`` requests in flight until the list is done; results in its order."""
    gate = asyncio.Semaphore(concurrency)
    bar = _bar(len(requests), progress, f"concurrency {concurrency}")

    async def one(req: BenchRequest) -> Timed:
        async with gate:
            out = await backend.send(req)
        bar.update(1)
        return out

    start = time.perf_counter()
    results = await asyncio.gather(*(one(r) for r in requests))
    bar.close()
    return list(results), time.perf_counter() - start


def arrival_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of ``n`` requests arrives: a Poisson process
    of ``rate`` per second (each request one exponential gap after the one before),
    scaled so that the last arrives at ``n / rate``; all at 0 for an infinite rate."""
    if not math.isfinite(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}-arrivals")
    offsets, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        offsets.append(t)
    scale = n / rate / t if t else 1.0
    return [offset * scale for offset in offsets]


def _bar(total: int, enabled: bool, label: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, disable=not enabled, leave=False)
