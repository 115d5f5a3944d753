"""The SLA planner under a load ramp (real processes): a 1 prefill + 1 decode cluster whose
planner grows the decode pool as the rate climbs and drains it back as the rate falls,
while every greedy stream finishes exactly (the chaos checker) and no worker, Redis key
or KV segment is left behind. The mesh runs deterministic (``EXACT_MESH``), so a greedy
stream's tokens equal the in-process engine's however it was batched or which worker,
added or drained, ran it.

The planner is given a profile (decode steps of 40 ms plus 20 ms a sequence, the ITL
target 100 ms: three sequences a worker, 30 tokens/s) instead of one measured here, and
no correction, so which pool size each rate needs is arithmetic, not this machine's
speed: up to 1.25 req/s of 24 tokens needs one decode worker, 4 req/s four (capped at
three)."""

from __future__ import annotations

import asyncio
import time

from control_plane.bench.load import Ramp
from control_plane.cli.launcher import Cluster, ClusterSpec
from control_plane.plan.hardware import CATALOG
from control_plane.plan.model_dir import model_shape
from control_plane.plan.profile import Profile
from control_plane.plan.sizing import Sizer, Slo
from control_plane.planner.policy import PlannerConfig, Policy
from control_plane.planner.scaler import LauncherScaler
from control_plane.planner.sla_planner import PlannerThread, SlaPlanner
from kervan.engine_args import EngineArgs
from tests.chaos.checker import check, record, stream, wait_baseline
from tests.conftest import EXACT_MESH, EXACT_REFERENCE, greedy_tokens, make_prompts

OUTPUT_TOKENS = 24
RAMP = Ramp(((4.0, 0.25), (10.0, 4.0), (6.0, 0.25)))


def synthetic_profile() -> Profile:
    steps = {b: 0.04 + 0.02 * b for b in (1, 2, 4, 8, 16)}
    return Profile(model="tiny", dtype="float32", machine={}, decode_s={64: steps, 512: steps},
                   prefill_s={16: 0.01, 64: 0.02, 512: 0.1})


async def ramp_streams(address: str, prompts: list[list[int]]) -> list:
    start = time.monotonic()

    async def one(prompt, at):
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        return await stream(address, prompt, OUTPUT_TOKENS)
    return await asyncio.gather(*(one(p, at) for p, at in zip(prompts, RAMP.offsets(seed=3))))


def test_the_planner_grows_the_decode_pool_with_the_ramp_and_drains_it_after_losing_nothing(llama, tmp_path):
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=1, num_decode=1,
                                  engine=EngineArgs(**EXACT_MESH, num_kv_blocks=256),
                                  metrics=True, worker_args=("--drain-grace", "20"),
                                  registry_args=("--ttl", "2")), tmp_path)
    cluster.start(timeout=240)
    thread = None
    try:
        shape, weights, _ = model_shape(str(llama[1]))
        sizer = Sizer(shape, weights, "float32", CATALOG["l40s"], profile=synthetic_profile())
        config = PlannerConfig(Slo(ttft_s=5.0, itl_s=0.1), min_prefill=1, max_prefill=1, min_decode=1,
                               max_decode=3, interval_s=1.5, scale_up_cooldown_s=1.5, scale_down_cooldown_s=2.0,
                               correct=False)
        scaler = LauncherScaler(cluster, drain_grace_s=30)
        planner = SlaPlanner(Policy(sizer, config), scaler, scaler.metrics_targets, tmp_path / "planner.jsonl",
                             say=lambda line: None)
        thread = PlannerThread(planner, cluster.reap_drained)
        thread.start()
        prompts = make_prompts([24] * RAMP.num_requests, seed=90)
        outcomes = asyncio.run(ramp_streams(cluster.router_address, prompts))
        deadline = time.monotonic() + 60  # the low rate goes on (no load now): the pool drains back
        while scaler.replicas()["decode"] > 1 or cluster.draining:
            assert time.monotonic() < deadline, f"decode pool never drained back: {thread.sizes[-1]}"
            time.sleep(0.2)
        thread.stop()

        counts = check(outcomes, greedy_tokens(llama[1], prompts, OUTPUT_TOKENS, **EXACT_REFERENCE))
        assert counts["completed"] == len(prompts)
        peak = max(sizes["decode"] for _, sizes in thread.sizes)
        assert peak == 3, [r.get("reasons") for r in planner.records]
        grew = [r for r in planner.records if r.get("target", {}).get("decode", 0) > r.get("current", {}).get("decode",
                                                                                                               9)]
        assert grew and grew[0]["observed"]["rate"] > 1.0  # it grew for the high phase, not before
        assert planner.stopped is None and {r.get("skipped") for r in planner.records[1:]} == {None}
        logs = [(tmp_path / f"decode-{i}.log").read_text() for i in range(cluster.spawned["decode"])]
        exits = [(line, "worker ready on" in text) for text in logs for line in text.splitlines()
                 if line.startswith("--- drained")]
        # every worker it added was drained again, cleanly (a burst in a low phase may add one early);
        # one told to stop while it still started (a loaded machine) had served nothing, and died of
        # the SIGTERM it had no handler for yet
        assert len(exits) == cluster.spawned["decode"] - 1, exits
        assert all(line == "--- drained, exited with 0 ---" or (line == "--- drained, exited with -15 ---"
                                                                and not served) for line, served in exits), exits
        asyncio.run(wait_baseline(cluster, ["prefill-0", "decode-0"]))
        record("planner_ramp", f"load ramp {RAMP.phases}: decode pool 1 -> {peak} -> 1 by the planner", counts)
    finally:
        if thread is not None:
            thread.stop()  # before the cluster's stop: nothing may start a worker meanwhile
        cluster.stop()
