"""When a benchmark sends its requests.

- Open loop (``rate``): arrivals form a Poisson process of ``rate`` requests per
  second (exponential gaps from a seeded generator, scaled so that the N-th request
  arrives at N / rate, as ``vllm bench serve`` scales them: every run's mean rate is
  the one asked for; ``inf`` sends them all at once),
  independent of how fast the server answers: a server that falls behind builds a
  queue and its latencies show it, as a real one's would. ``max_concurrency`` caps
  the requests in flight (arrivals wait for a slot), as ``vllm bench serve`` does.
- Ramp (``Ramp``): an open loop whose rate changes in steps (``30:1,60:4,30:1``: 30 s at
  1/s, 60 s at 4/s, 30 s at 1/s), a Poisson process of that piecewise rate; what a
  planner that scales pools is tested under.
- Closed loop (``concurrency``): N requests in flight, each sent when one finishes.

Every request list is bounded; the progress bar (tqdm) goes to stderr."""

from __future__ import annotations

import asyncio
import math
import random
import time
from typing import NamedTuple

from .backends import Timed
from .workload import BenchRequest


class Ramp(NamedTuple):
    """A rate that changes in steps: (seconds, requests per second) phases, in order."""
    phases: tuple[tuple[float, float], ...]

    @staticmethod
    def parse(text: str) -> Ramp:
        """``"30:1,60:4,30:1"`` -> 30 s at 1/s, then 60 s at 4/s, then 30 s at 1/s."""
        phases = []
        for item in text.split(","):
            seconds, _, rate = item.partition(":")
            try:
                phase = (float(seconds), float(rate))
            except ValueError:
                raise ValueError(f"ramp phase {item!r}: expected SECONDS:RATE") from None
            if not (math.isfinite(phase[0]) and math.isfinite(phase[1])) or phase[0] <= 0 or phase[1] < 0:
                raise ValueError(f"ramp phase {item!r}: seconds must be positive and the rate finite, >= 0")
            phases.append(phase)
        if not any(rate for _, rate in phases):
            raise ValueError(f"ramp {text!r} sends nothing: every rate is 0")
        return Ramp(tuple(phases))

    @property
    def num_requests(self) -> int:
        """The requests the ramp sends: each phase's seconds times its rate, rounded."""
        return round(sum(seconds * rate for seconds, rate in self.phases))

    def offsets(self, seed: int = 0) -> list[float]:
        """Arrival times: a unit-rate Poisson process mapped through the inverse of the ramp's
        cumulative rate (a non-homogeneous Poisson process), scaled as ``arrival_offsets`` is
        so that the last of ``num_requests`` arrives at the ramp's end."""
        n = self.num_requests
        units = arrival_offsets(n, 1.0, seed)
        total = sum(seconds * rate for seconds, rate in self.phases)
        return [self._time_at(u * total / n) for u in units] if n else []

    def _time_at(self, mass: float) -> float:
        start = 0.0
        for seconds, rate in self.phases:
            if rate and mass <= seconds * rate:
                return start + mass / rate
            mass -= seconds * rate
            start += seconds
        return start

    def phase_of(self, offset: float) -> int:
        """The index of the phase an arrival at ``offset`` seconds falls in."""
        end = 0.0
        for i, (seconds, _) in enumerate(self.phases):
            end += seconds
            if offset <= end:
                return i
        return len(self.phases) - 1


async def run_open_loop(backend, requests: list[BenchRequest], rate: float | Ramp, seed: int = 0,
                        max_concurrency: int | None = None, progress: bool = True) -> tuple[list[Timed], float]:
    """Every request, arriving at ``rate`` per second (or as a ``Ramp`` says); results in
    ``requests``' order and the wall time from the start (the first request arrives one gap
    after it, as in ``vllm bench serve``) to the last answer."""
    if isinstance(rate, Ramp):
        offsets, label = rate.offsets(seed)[:len(requests)], "ramp"
    else:
        offsets, label = arrival_offsets(len(requests), rate, seed), f"rate {rate:g}/s"
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = _bar(len(requests), progress, label)

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
    from kervan.progress import bar
    return bar(total, label, unit="req", quiet=not enabled)  # drawn on a terminal only, as every wait's
