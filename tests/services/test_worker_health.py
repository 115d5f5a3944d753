"""A worker's health follows its engine: one whose steps all fail, whose engine thread
died or is wedged leaves the mesh by itself (before, it kept heartbeating, looked idle
and drew placements), and the router places the requests it failed elsewhere."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.proto import kv_registry_pb2
from tests.chaos.checker import check, record, stream
from tests.conftest import greedy_tokens, make_prompts
from tests.services.scheduled_mesh import address
from tests.services.test_membership import until


async def listed(mesh) -> list[str]:
    reply = await mesh.registry_stub.ListWorkers(kv_registry_pb2.ListWorkersRequest(), timeout=10)
    return sorted(w.info.address for w in reply.workers)


async def test_a_worker_whose_steps_all_fail_leaves_the_mesh_and_no_request_is_lost(mesh, llama):
    sick, healthy = mesh.workers

    def failing_step():
        raise RuntimeError("injected: every step fails")
    sick.engine.engine.step = failing_step
    # one failure is enough here: the router avoids a worker that failed a request for a while,
    # so a second request rarely reaches it (three in a row: the test below)
    sick.engine.max_step_failures = 1
    prompts = make_prompts([20 + i for i in range(12)], seed=140)
    outs = []
    at = time.monotonic()
    for prompt in prompts:  # sequential: idle workers tie on load, so placements reach the sick one
        outs.append(await stream(address(mesh), prompt, 6))
        if sick.engine.health() is not None:
            break
    assert sick.engine.health() == "1 engine steps in a row failed"
    # every request failed on the sick worker before its first token was placed again: none lost
    counts = check(outs, greedy_tokens(llama[1], prompts[:len(outs)], 6))
    assert counts["completed"] == len(outs) and counts["lost"] == 0
    await until(lambda: _equals(listed(mesh), [healthy.address]))  # it deregistered itself
    record("worker_steps_all_fail", "every engine step of one of two workers fails (in process); "
           "time: to the worker leaving the mesh", counts, round(time.monotonic() - at, 3))
    assert sick.membership.done()
    out = await stream(address(mesh), prompts[0], 6)
    assert out.status is None


async def _equals(awaitable, expected) -> bool:
    return await awaitable == expected


@pytest.mark.mesh(first_token_timeout_s=2.0)
async def test_a_wedged_engine_thread_takes_its_worker_out_of_the_mesh(mesh, llama):
    """Requests placed on the wedged worker meanwhile get no first token: after 2 s the
    router takes it for lost and places them on the other, and every one completes."""
    stuck, healthy = mesh.workers
    stuck.engine.wedge_timeout_s = 3.0
    release = threading.Event()
    stuck.engine.post(lambda e: release.wait(60))  # the engine thread never comes back from this
    at = time.monotonic()
    prompts = make_prompts([20 + i for i in range(4)], seed=141)
    try:
        outs = await asyncio.gather(*(stream(address(mesh), p, 6, timeout=60) for p in prompts))
        await until(lambda: _equals(listed(mesh), [healthy.address]))
        assert "wedged" in stuck.engine.health()
    finally:
        release.set()
    counts = check(outs, greedy_tokens(llama[1], prompts, 6))
    assert counts["completed"] == len(prompts)
    record("engine_wedged", "one of two workers' engine thread wedged (in process); time: to the worker "
           "leaving the mesh", counts, round(time.monotonic() - at, 3))


async def test_an_engine_thread_that_dies_is_reported_not_serving(mesh):
    dying = mesh.workers[0]

    def die(engine):
        raise SystemExit("injected: the engine thread ends")
    dying.engine.post(die)  # not an Exception: it ends the engine thread
    await until(lambda: _dead(dying))
    assert "the engine thread died: SystemExit" in dying.engine.health()
    await until(lambda: _equals(listed(mesh), [mesh.workers[1].address]))


async def _dead(worker) -> bool:
    return worker.engine.health() is not None


async def test_only_failures_in_a_row_count_against_the_engine(llama):
    from services.worker.async_engine import AsyncEngine
    from tests.conftest import make_engine
    from worker import SamplingParams
    engine = AsyncEngine(make_engine(llama[1]))
    real = engine.engine.step
    failing = [True]

    def step():
        if failing[0]:
            raise RuntimeError("injected")
        return real()
    engine.engine.step = step
    engine.start()
    params = SamplingParams(max_tokens=2, temperature=0.0)

    async def one(rid):
        try:
            async for _ in engine.generate(rid, [5, 6, 7], params):
                pass
        except RuntimeError:
            return False
        return True
    try:
        assert [await one(f"r{k}") for k in range(2)] == [False, False] and engine.health() is None
        failing[0] = False
        assert await one("ok") and engine.health() is None  # a good step resets the count
        failing[0] = True
        assert [await one(f"s{k}") for k in range(3)] == [False] * 3
        assert engine.health() == "3 engine steps in a row failed"
    finally:
        engine.stop()


async def test_a_worker_without_a_registry_turns_not_serving_and_exits_when_its_engine_fails(monkeypatch):
    """No registry to leave: health NOT_SERVING (probes, load balancers), then exit 70."""
    from services.worker import __main__ as worker_main
    reasons = iter([None, None, "3 engine steps in a row failed"])
    engine = type("Engine", (), {"health": lambda self: next(reasons)})()
    served = []
    handle = type("Handle", (), {"set_serving": lambda self, on: _append(served, on)})()
    exits = []
    monkeypatch.setattr(worker_main.os, "_exit", exits.append)
    await worker_main._exit_when_unhealthy(engine, handle, interval_s=0.01)
    assert served == [False] and exits == [70]


async def _append(items, item):
    items.append(item)

