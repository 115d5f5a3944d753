"""One source for a request's limits: each worker registers the longest request and
the most samples it serves (its engine's limits), the scheduler places a request only
on a worker whose limits hold it, and one no worker holds is the client's mistake
(INVALID_ARGUMENT naming the largest limit), never a worker's refusal after placement."""

import grpc
import pytest

from tests.chaos.checker import stream
from tests.conftest import make_prompts
from tests.services.scheduled_mesh import ScheduledMesh, address


async def cached_blocks(worker) -> int:
    return len((await worker.engine.call(lambda e: e.cached_blocks()))[1])


@pytest.mark.mesh(workers=1)
async def test_the_scheduler_places_by_the_limits_workers_register_and_refuses_what_none_holds(
        mesh: ScheduledMesh):
    big = mesh.workers[0]
    small = await mesh.add_worker(num_kv_blocks=8)  # 8 blocks of 16 tokens: its KV holds 128
    assert (big.engine.limits.max_model_len, small.engine.limits.max_model_len) == (512, 128)
    for seed in range(3):  # 100 + 60 tokens: only the big worker holds it, though the small one is idle
        out = await stream(address(mesh), make_prompts([100], seed=170 + seed)[0], 60)
        assert not out.status and len(out.tokens) == 60, out.details
    assert await cached_blocks(small) == 0 and await cached_blocks(big) >= 3 * 6

    out = await stream(address(mesh), make_prompts([400], seed=173)[0], 200)
    assert out.status == grpc.StatusCode.INVALID_ARGUMENT
    assert out.details == "prompt (400 tokens) + max_tokens (200) exceeds the maximum model length 512"
    out = await stream(address(mesh), make_prompts([10], seed=174)[0], 4, n=17)
    assert (out.status, out.details) == (grpc.StatusCode.INVALID_ARGUMENT, "n must be <= 16, got 17")
    assert await cached_blocks(small) == 0 and mesh.router_servicer.in_flight == set()
