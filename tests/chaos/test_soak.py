"""Chaos soak: mixed load for a bounded time while faults are injected at random
(fixed seed): workers SIGKILLed and replaced, Redis restarted empty. Every request
must end exactly once with its fault-free tokens; the services' memory and open file
descriptors must stay flat."""

from __future__ import annotations

import asyncio
import os
import random
import time

from control_plane.launcher import Cluster, ClusterSpec
from tests.chaos.checker import check, process_gone, record, stream, wait_baseline
from tests.chaos.test_overload_and_cancel import rss_mb
from tests.conftest import make_engine, make_prompts
from worker import SamplingParams

SOAK_S = float(os.environ.get("KERVAN_SOAK_S", "40"))
SERVICES = ("router", "scheduler", "kv-registry")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_soak_with_random_faults(llama, tmp_path):
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=0, num_decode=0, num_both=2, dtype="float32",
                                  num_kv_blocks=256, registry_args=("--ttl", "2"),
                                  router_args=("--stall-timeout-s", "3")), tmp_path)
    cluster.start(timeout=240)
    rng = random.Random(1234)
    try:
        pool = make_prompts([12 + i % 11 for i in range(24)], seed=110)
        expected = [o.token_ids for o in make_engine(llama[1]).generate(
            pool, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))]
        asyncio.run(stream(cluster.router_address, pool[0], 4))  # warm-up before the baseline
        pids = {name: cluster.procs[name].pid for name in SERVICES}
        before = {name: (rss_mb(pid), fds(pid)) for name, pid in pids.items()}
        faults: list[str] = []

        async def soak():
            outcomes, which = [], []
            stop_at = time.monotonic() + SOAK_S

            async def client(k):
                crng = random.Random(k)
                while time.monotonic() < stop_at:
                    i = crng.randrange(len(pool))
                    outcomes.append(await stream(cluster.router_address, pool[i], 48))
                    which.append(i)

            async def injector():
                while time.monotonic() < stop_at - 6:
                    await asyncio.sleep(rng.uniform(4, 7))
                    workers = sorted(n for n in cluster.procs if n.startswith("both-"))
                    if rng.random() < 0.7 and len(workers) == 2:
                        victim = rng.choice(workers)
                        proc = cluster.procs.pop(victim)
                        proc.kill()
                        await asyncio.to_thread(process_gone, proc)
                        faults.append(f"SIGKILL {victim}")
                        await asyncio.to_thread(cluster.add_worker, "both")
                    else:
                        await asyncio.to_thread(cluster.restart_redis)
                        faults.append("Redis restarted empty")

            await asyncio.gather(injector(), *(client(k) for k in range(4)))
            return outcomes, which

        outcomes, which = asyncio.run(soak())
        assert faults, "no fault was injected"
        counts = check(outcomes, [expected[i] for i in which])
        assert counts["completed"] == len(outcomes)
        workers = sorted(n for n in cluster.procs if n.startswith("both-"))
        asyncio.run(wait_baseline(cluster, workers, f"redis://{cluster.addresses['redis']}/0", timeout=30))
        after = {name: (rss_mb(pid), fds(pid)) for name, pid in pids.items()}
        for name in SERVICES:
            assert after[name][0] - before[name][0] < 100, (name, before[name], after[name])
            assert after[name][1] - before[name][1] < 16, (name, before[name], after[name])
        counts.update(faults=faults, seconds=SOAK_S,
                      rss_mb={n: [round(before[n][0]), round(after[n][0])] for n in SERVICES},
                      fds={n: [before[n][1], after[n][1]] for n in SERVICES})
        record("soak", f"{SOAK_S:g} s of 4 clients with random faults (seed 1234)", counts)
    finally:
        cluster.stop()
