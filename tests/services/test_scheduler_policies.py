"""The baseline placement policies through the scheduler's real ``Place``: a real Redis,
the kv-registry and scheduler servers on loopback, workers registered in Redis."""

from __future__ import annotations

from pathlib import Path

import grpc

from kervan.block_hash import HASH_NAME
from kervan.kv_events import BlockStored
from kervan.sampling import RequestLimits
from kervan.worker_info import WorkerInfo, WorkerRole
from services.common.server import Service, start_server
from services.kv_registry.index import PrefixIndex
from services.proto import kv_registry_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.placement import PlacementConfig
from services.scheduler.recent import RecentPlacements
from services.scheduler.servicer import SchedulerServicer
from tests.services.conftest import start_registry


async def place_all(redis_client, policy: str | PlacementConfig, prompts: list[list[bytes]],
                    cached: dict | None = None, stats: list | None = None) -> list[str]:
    """Four aggregated workers (``cached``: worker id -> the blocks its KV events reported),
    then ``prompts`` placed one after the other; the decode addresses chosen (and, into
    ``stats``, the scheduler's GetStats after them). Placements count as load for no time
    at all: only what workers report does."""
    await redis_client.flushdb()
    cached = cached or {}
    index = PrefixIndex(redis_client, ttl_s=60)
    for w in range(4):
        wid = f"both@127.0.0.1:{7000 + w}"
        token = await index.register(WorkerInfo(
            worker_id=wid, address=wid.split("@")[1], role=WorkerRole.BOTH, model="m", block_size=16,
            hash_name=HASH_NAME, limits=RequestLimits(max_model_len=4096, max_n=4)))
        if cached.get(wid):
            await index.apply(wid, token, [BlockStored(1, cached[wid], None, [], 16)])
    registry = await start_registry(index)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{registry.port}") as reg:
        config = policy if isinstance(policy, PlacementConfig) else PlacementConfig(policy=policy)
        servicer = SchedulerServicer(kv_registry_pb2_grpc.KvRegistryServiceStub(reg), config,
                                     recent=RecentPlacements(load_window_s=0.0))
        scheduler = await start_server([Service("kervan.v1.SchedulerService", lambda s: (
            scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, s)))])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{scheduler.port}") as ch:
                stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
                placed = [(await stub.Place(scheduler_pb2.PlaceRequest(
                    request_id=f"r{i}", block_hashes=p, num_prompt_tokens=16 * len(p), max_tokens=4, n=1),
                    timeout=10)).decode_address for i, p in enumerate(prompts)]
                if stats is not None:
                    stats.append(await stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10))
                return placed
        finally:
            await scheduler.stop(0)
            await registry.stop(0)


def prompt(system: int, user: int) -> list[bytes]:
    return [bytes([system, k]) * 16 for k in range(6)] + [bytes([200 + user % 50, user // 50]) * 16]


async def test_prefix_hash_keeps_each_system_prompt_on_one_worker(redis_client):
    prompts = [prompt(s, u) for u in range(6) for s in range(8)]
    placed = await place_all(redis_client, "prefix_hash", prompts)
    by_system = {s: {a for p, a in zip(prompts, placed) if p[0] == prompt(s, 0)[0]} for s in range(8)}
    assert all(len(workers) == 1 for workers in by_system.values())
    assert len({next(iter(w)) for w in by_system.values()}) > 1  # the systems spread over the ring


async def test_approx_tree_follows_what_it_sent_not_what_workers_report(redis_client, caplog):
    # worker 3 really caches system 0, but the approximate tree only knows what it sent
    first, stats = prompt(0, 0), []
    placed = await place_all(redis_client, "approx_tree", [prompt(0, u) for u in range(5)],
                             cached={"both@127.0.0.1:7003": first[:6]}, stats=stats)
    # the first went to the smallest tree (all empty: the first id); the rest followed it there
    assert placed == ["127.0.0.1:7000"] * 5
    assert dict(stats[0].by_policy_branch) == {"smallest_tree": 1, "cache": 4}  # which rule chose, counted
    with caplog.at_level("DEBUG", logger="services.scheduler.servicer"):
        placed_kv = await place_all(redis_client, "kv", [first], cached={"both@127.0.0.1:7003": first[:6]})
    assert placed_kv == ["127.0.0.1:7003"]  # KV events: kv placement finds the real cache
    # at DEBUG each decision explains itself: (cost, matched, active, free) per worker
    [why] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("place r0")]
    assert "6 of 7 blocks cached" in why and "'both@127.0.0.1:7003': (" in why


async def test_new_prefix_content_spreads_new_prompts_that_no_report_shows_yet(redis_client):
    # four new system prompts in a row, every worker reporting idle and empty: the cost ties
    # and the first id wins each time; "content" counts the prompts it has just sent
    prompts = [prompt(s, 0) for s in range(4)]
    placed = await place_all(redis_client, PlacementConfig(new_prefix="content"), prompts)
    assert sorted(placed) == [f"127.0.0.1:{7000 + w}" for w in range(4)]
    assert await place_all(redis_client, "kv", prompts) == ["127.0.0.1:7000"] * 4


def test_every_placement_setting_has_a_scheduler_flag():
    """``python -m services.scheduler`` hands each flag to its PlacementConfig field: a
    field added without a flag, or a flag wired to the wrong field, fails here."""
    import dataclasses

    from services.scheduler.__main__ import parse_args, placement_config

    values = {"policy": "approx_tree", "overlap_weight": 3.5, "eviction_weight": 0.25, "temperature": 0.5,
              "min_remote_prefill_blocks": 7, "max_prefill_queue_tokens": 99, "hash_prefix_blocks": 3,
              "cache_threshold": 0.75, "balance_abs_threshold": 5, "balance_rel_threshold": 1.5,
              "new_prefix": "content", "host_block_cost": 0.3, "disk_block_cost": 0.45,
              "pull_block_cost": 0.05, "link_bytes_per_s": 1.25e9, "link_latency_s": 0.002,
              "prefill_tokens_per_s": 5000.0, "kv_fetch": False}
    assert set(values) == {f.name for f in dataclasses.fields(PlacementConfig)}
    assert all(getattr(PlacementConfig(), k) != v for k, v in values.items())  # none is the default
    argv = ["--registry", "127.0.0.1:1"]
    for name, value in values.items():
        argv += ["--no-kv-fetch"] if name == "kv_fetch" else [f"--{name.replace('_', '-')}", str(value)]
    assert placement_config(parse_args(argv)) == PlacementConfig(**values)


def test_contributings_recipe_for_a_policy_registers_it_by_its_name(monkeypatch):
    """CONTRIBUTING.md, "Add a placement policy": a class with ``name``, decorated with
    ``@register`` (no arguments), is offered by that name."""
    from services.scheduler.policies import base
    monkeypatch.setattr(base, "POLICIES", dict(base.POLICIES))

    @base.register
    class FirstPolicy(base.PlacementPolicy):
        name = "first_of_pool"

        def choose(self, pool, ask):
            return pool[0]

    assert base.POLICIES["first_of_pool"] is FirstPolicy
    contributing = (Path(__file__).resolve().parents[2] / "CONTRIBUTING.md").read_text()
    assert "decorated with `@register` (no arguments" in contributing
