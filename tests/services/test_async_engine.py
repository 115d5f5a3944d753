"""The engine thread's inbox: typed commands, and an unknown one is a bug (before,
anything unrecognised was taken for an abort)."""

import asyncio

import pytest

from services.worker.async_engine import AsyncEngine
from tests.conftest import make_engine, make_prompts
from worker import SamplingParams


async def test_commands_reach_the_engine_and_an_unknown_one_is_a_bug(llama):
    engine = AsyncEngine(make_engine(llama[1]))
    engine.start()
    try:
        prompt = make_prompts([9], seed=150)[0]
        outs = [o async for o in engine.generate("r1", prompt, SamplingParams(max_tokens=3, temperature=0))]
        assert outs[-1].finished and len(outs[-1].token_ids) == 3
        assert await engine.call(lambda e: e.has_unfinished_requests()) is False
        for _ in range(500):  # the engine's stats as of its last loop, with the worker's own counts
            load = engine.load()
            if load.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert (load.num_running, load.num_waiting, load.num_requests, load.num_aborted) == (0, 0, 0, 0)
        assert load.num_blocks == 128 and load.num_free_blocks == 128 and load.num_evictable_blocks > 0
        with pytest.raises(ZeroDivisionError):  # an engine call's exception reaches its caller
            await engine.call(lambda e: 1 / 0)
    finally:
        engine.stop()
    engine._post(("abort", "r1"))  # the old tuple form
    with pytest.raises(TypeError, match="unknown engine command"):
        engine._drain_inbox()
