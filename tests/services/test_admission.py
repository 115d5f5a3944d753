"""Admission control: past its limit a worker refuses new requests at once with
RESOURCE_EXHAUSTED and a RetryInfo (before doing any work for them), and the
requests it took still finish."""

from __future__ import annotations

import asyncio

import grpc

from services.common.errors import retry_after_s
from services.proto import common_pb2, router_pb2
from tests.conftest import make_prompts
from tests.services.conftest import start_mesh


async def test_overload_is_refused_fast_with_retry_info_and_accepted_requests_finish(llama):
    mesh, stop = await start_mesh(llama[1], max_waiting=2, max_num_seqs=2)
    try:
        prompts = make_prompts([12] * 16, seed=60)

        async def one(prompt):
            tokens = 0
            try:
                async for msg in mesh.router.Generate(router_pb2.GenerateRequest(
                        token_ids=common_pb2.TokenIds(ids=prompt),
                        sampling=common_pb2.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)),
                        timeout=60):
                    tokens += len(msg.delta.token_ids)
                return "ok", tokens
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                assert "limit" in err.details() and retry_after_s(err) == 0.5
                return "refused", 0

        results = await asyncio.gather(*(one(p) for p in prompts))  # 4 times what the worker admits
        ok = [r for r in results if r[0] == "ok"]
        refused = [r for r in results if r[0] == "refused"]
        assert len(ok) >= 4 and len(refused) >= 8
        assert all(tokens == 200 for _, tokens in ok)
        for _ in range(100):
            load = mesh.workers[0].engine.load()
            if load.num_free_blocks == load.num_blocks and not load.num_running:
                break
            await asyncio.sleep(0.05)
        assert load.num_free_blocks == load.num_blocks and not load.num_running
    finally:
        await stop()
