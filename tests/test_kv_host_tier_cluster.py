"""`kervan up --kv-host-bytes` as real processes: a prompt the worker's pool has reused since
comes back from host memory (its prompt tokens counted cached, its greedy tokens those of
the first time), the registry hears which of the worker's blocks live in host memory (its
Match says so, for the scheduler's cost), and the worker's metrics count the copies.
The greedy tokens are compared in float32 with the default kernels; the promoted prefix is
the very KV computed the first time, and only the last prompt block is computed again."""

from __future__ import annotations

import asyncio

import grpc
import redis.asyncio as redis

from control_plane.cli.launcher import Cluster, ClusterSpec
from kervan.block_hash import hash_blocks
from kervan.engine_args import EngineArgs
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc
from tests.cluster_helpers import complete, wait_idle
from tests.conftest import make_prompts
from tests.test_cluster import sample, scrape


def test_a_prompt_evicted_from_the_pool_comes_back_from_host_memory(llama, tmp_path):
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=0, num_decode=0, num_both=1,
                                  engine=EngineArgs(dtype="float32", num_kv_blocks=12,
                                                    kv_host_bytes=1 << 20), metrics=True), tmp_path)
    cluster.start(timeout=240)
    try:
        first, *others = make_prompts([120, 120, 120], seed=62)  # 12 blocks of 16: one prompt fills the pool

        async def run():
            kwargs = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
            before = await complete(cluster, token_ids=first, **kwargs)
            for prompt in others:
                await complete(cluster, token_ids=prompt, **kwargs)
            await wait_idle(cluster)  # the events of the demotions have reached the registry
            async with grpc.aio.insecure_channel(cluster.addresses["kv-registry"]) as ch:
                match = await kv_registry_pb2_grpc.KvRegistryServiceStub(ch).Match(
                    kv_registry_pb2.MatchRequest(block_hashes=hash_blocks(first, 16)), timeout=10)
            again = await complete(cluster, token_ids=first, **kwargs)
            await wait_idle(cluster)
            r = redis.Redis.from_url(cluster.redis_url)
            try:
                tiers = [t.decode() for t in (await r.hgetall("kervan:own:both@" + cluster.addresses["both-0"])
                                              ).values()]
            finally:
                await r.aclose()
            return before, again, tiers, match
        before, again, tiers, match = asyncio.run(run())
        worker = "both@" + cluster.addresses["both-0"]
        # what placement sees: all 7 blocks held, those the pool reused since in host memory
        assert match.matched_blocks[worker] == 7 and 1 <= match.host_blocks[worker] <= 7
        assert before.usage["cached_prompt_tokens"] == 0
        assert again.usage["cached_prompt_tokens"] == 112  # 7 full blocks back from host memory
        assert again.token_ids == before.token_ids
        assert "host" in tiers and "device" in tiers
        metrics = scrape(cluster.addresses["both-0-metrics"])
        assert sample(metrics, "kervan_kv_host_promoted_blocks_total") >= 7
        assert sample(metrics, "kervan_kv_host_blocks") > 0
        listed = asyncio.run(live_workers(cluster))  # the heartbeat load the mesh page shows per tier
        assert [w.load.num_host_blocks for w in listed] == [sample(metrics, "kervan_kv_host_blocks")]
        assert listed[0].load.num_disk_blocks == 0
    finally:
        cluster.stop()


async def live_workers(cluster: Cluster, settle_s: float = 1.5) -> list:
    await asyncio.sleep(settle_s)  # a heartbeat (every second) carries the load the scrape just read
    async with grpc.aio.insecure_channel(cluster.addresses["kv-registry"]) as ch:
        return list((await kv_registry_pb2_grpc.KvRegistryServiceStub(ch).ListWorkers(
            kv_registry_pb2.ListWorkersRequest(), timeout=10)).workers)


def test_a_restarted_cluster_finds_its_prompts_on_disk_and_the_registry_hears_of_them(llama, tmp_path):
    """`kervan up --kv-disk-dir --kv-disk-bytes`: a prompt evicted from the pool and pushed out
    of a two-block host tier is on disk; the whole cluster stops and starts again (a new
    worker, Redis and registry), and the worker's first full dump tells the registry the
    block is on its disk: the Match says so, the prompt is read back, not computed. (The worker
    writes what its pool and host tier hold to disk as it stops, so all 7 blocks are there.)"""
    engine = EngineArgs(dtype="float32", num_kv_blocks=12, kv_host_bytes=2 * 16 << 10,
                        kv_disk_dir=str(tmp_path / "disk"), kv_disk_bytes=8 << 20)
    spec = dict(num_prefill=0, num_decode=0, num_both=1, engine=engine, metrics=True)
    first, *others = make_prompts([120, 120, 120], seed=63)
    kwargs = dict(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def fill(cluster):
        before = await complete(cluster, token_ids=first, **kwargs)
        for prompt in others:
            await complete(cluster, token_ids=prompt, **kwargs)
        await wait_idle(cluster)
        return before

    async def revisit(cluster):
        async with grpc.aio.insecure_channel(cluster.addresses["kv-registry"]) as ch:
            for _ in range(100):  # the worker's first full dump follows its registration
                match = await kv_registry_pb2_grpc.KvRegistryServiceStub(ch).Match(
                    kv_registry_pb2.MatchRequest(block_hashes=hash_blocks(first, 16)), timeout=10)
                if match.matched_blocks:
                    break
                await asyncio.sleep(0.1)
        return match, await complete(cluster, token_ids=first, **kwargs)

    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    cluster = Cluster(ClusterSpec(llama[1], **spec), tmp_path / "first")
    cluster.start(timeout=240)
    try:
        before = asyncio.run(fill(cluster))
    finally:
        cluster.stop()  # the worker closes its engine: the queued writes are made
    assert (tmp_path / "disk" / "both-0" / "kv-blocks.bin").stat().st_size > 8 << 20
    cluster = Cluster(ClusterSpec(llama[1], **spec), tmp_path / "second")
    cluster.start(timeout=240)
    try:
        match, again = asyncio.run(revisit(cluster))
        worker = "both@" + cluster.addresses["both-0"]
        assert match.matched_blocks[worker] == 7 and match.disk_blocks[worker] == 7
        assert again.usage["cached_prompt_tokens"] == 112 and again.token_ids == before.token_ids
        metrics = scrape(cluster.addresses["both-0-metrics"])
        assert sample(metrics, "kervan_kv_disk_loaded_blocks_total") >= 7
        assert sample(metrics, "kervan_kv_disk_corrupt_blocks_total") == 0
    finally:
        cluster.stop()


def test_a_prefix_another_worker_holds_is_pulled_over_the_kv_transfer(llama, tmp_path):
    """Two aggregated workers, the scheduler alternating between them (round robin: the cost
    would send the revisit back to the holder) with pulls on: the second request for the same
    prompt goes to the worker that lacks it, and the holder prefills it — computing one block,
    not eight — and pushes the whole prompt's KV to it. Same greedy tokens (float32, the very
    KV computed the first time)."""
    from tests.cluster_helpers import scheduler_stats, wait_cached
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=0, num_decode=0, num_both=2,
                                  engine=EngineArgs(dtype="float32", num_kv_blocks=64),
                                  scheduler_args=("--policy", "round_robin", "--pull-block-cost", "0.1")), tmp_path)
    cluster.start(timeout=240)
    try:
        prompt = make_prompts([120], seed=65)[0]
        kwargs = dict(max_tokens=8, temperature=0.0, ignore_eos=True)

        async def run():
            before = await complete(cluster, token_ids=prompt, **kwargs)
            await wait_cached(cluster, prompt, 7)
            again = await complete(cluster, token_ids=prompt, **kwargs)
            return before, again, await scheduler_stats(cluster)
        before, again, stats = asyncio.run(run())
        assert stats.by_prefill_reason["aggregated"] == 1 and stats.by_prefill_reason["pull"] == 1
        assert before.usage["cached_prompt_tokens"] == 0
        assert again.usage["cached_prompt_tokens"] == 112  # the holder's 7 blocks, not recomputed
        assert again.token_ids == before.token_ids
    finally:
        cluster.stop()
