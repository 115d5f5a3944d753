"""Chaos: Redis killed and restarted empty under load."""

from __future__ import annotations

import asyncio
import time

import grpc
import redis.asyncio as redis

from control_plane.cli.launcher import Cluster, ClusterSpec
from kervan.block_hash import hash_blocks
from kervan.engine_args import EngineArgs
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc
from tests.chaos.checker import check, record, restart_redis, stream, wait_baseline
from tests.conftest import EXACT_MESH, EXACT_REFERENCE, greedy_tokens, make_prompts


def test_redis_restarting_empty_starts_a_generation_and_requests_keep_flowing(llama, tmp_path):
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=0, num_decode=0, num_both=2,
                                  engine=EngineArgs(**EXACT_MESH, num_kv_blocks=256),
                                  registry_args=("--ttl", "2")), tmp_path)
    cluster.start(timeout=240)
    url = cluster.redis_url
    try:
        prompts = make_prompts([20 + i % 7 for i in range(32)], seed=80)
        expected = greedy_tokens(llama[1], prompts, 40, **EXACT_REFERENCE)

        async def run_id():
            r = redis.Redis.from_url(url)
            try:
                return (await r.info("server"))["run_id"]
            finally:
                await r.aclose()

        async def load_with_a_restart():
            before = await run_id()
            done, results = [], [None] * len(prompts)

            async def client(k):
                for i in range(k, len(prompts), 4):
                    results[i] = await stream(cluster.router_address, prompts[i], 40)
                    done.append(i)

            clients = asyncio.gather(*(client(k) for k in range(4)))
            while len(done) < 6:
                await asyncio.sleep(0.02)
            at = time.monotonic()
            await asyncio.to_thread(restart_redis, cluster)
            after = await run_id()
            assert after != before  # the fault happened: another Redis, empty
            await clients
            return results, at

        results, restarted_at = asyncio.run(load_with_a_restart())
        counts = check(results, expected)
        assert counts["completed"] == len(prompts)

        async def rebuilt():  # both workers registered again, and their blocks re-sent
            await wait_baseline(cluster, ["both-0", "both-1"], url)
            async with grpc.aio.insecure_channel(cluster.addresses["kv-registry"]) as ch:
                stub = kv_registry_pb2_grpc.KvRegistryServiceStub(ch)
                for _ in range(100):
                    match = await stub.Match(kv_registry_pb2.MatchRequest(block_hashes=hash_blocks(prompts[0], 16)))
                    if match.matched_blocks and not match.unknown_workers:
                        return
                    await asyncio.sleep(0.05)
            raise AssertionError("the registry never got the workers' blocks back")

        asyncio.run(rebuilt())
        firsts = [min(r.first_token_after.values()) for r in results if r.first_token_after]
        after = [t for t in firsts if t > restarted_at]
        record("redis_restart_empty", "Redis SIGKILLed and restarted empty under load", counts,
               round(min(after) - restarted_at, 3) if after else None)
    finally:
        cluster.stop()
