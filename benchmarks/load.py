"""The benchmarks' client side, on ``kervan bench``'s load generator (``control_plane/bench``):
a bounded list of (prompt token ids, output tokens) through a router, timed per token."""

from __future__ import annotations

from control_plane.bench import load
from control_plane.bench.backends import KervanBackend, Timed
from control_plane.bench.workload import BenchRequest
from services.common.security import PLAINTEXT, MeshSecurity

__all__ = ["Timed", "pct_ms", "run_closed_loop"]


async def run_closed_loop(address: str, work: list[tuple[list[int], int]], concurrency: int,
                          warm_up: bool = True, security: MeshSecurity = PLAINTEXT) -> tuple[list[Timed], float]:
    """Every (prompt, max_tokens) of ``work``, ``concurrency`` at a time; the results in
    ``work``'s order and the wall time."""
    async with KervanBackend(address, security) as backend:
        if warm_up:
            await backend.send(BenchRequest([5] * 8, 2))  # connections, first-call costs
        results, wall = await load.run_closed_loop(backend, [BenchRequest(p, n) for p, n in work], concurrency,
                                                   progress=False)
    failed = [r.error for r in results if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed: {sorted(set(failed))}")
    return results, wall


def pct_ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q / 100 * len(values)))] * 1000, 2)
