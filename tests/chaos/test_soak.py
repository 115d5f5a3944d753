"""Chaos soak: mixed load for a bounded time while faults are injected at random
(fixed seed): workers SIGKILLed and replaced, Redis restarted empty. Every request
must end exactly once with its fault-free tokens; the services' memory, open file
descriptors, threads and asyncio tasks (their RuntimeService) must stay flat."""

from __future__ import annotations

import asyncio
import os
import random
import time

from control_plane.launcher import Cluster, ClusterSpec
from tests.chaos.checker import check, process_gone, record, runtime, stream, wait_baseline
from tests.conftest import make_engine, make_prompts
from worker import SamplingParams

SOAK_S = float(os.environ.get("KERVAN_SOAK_S", "40"))
SERVICES = ("router", "scheduler", "kv-registry")  # the workers are replaced as the soak goes


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
        before = asyncio.run(runtime(cluster, SERVICES))
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
        after = asyncio.run(runtime(cluster, SERVICES))
        for name in SERVICES:  # flat: no memory, file descriptors, threads or tasks left behind by faults
            b, a = before[name], after[name]
            assert a.rss_bytes - b.rss_bytes < 100 << 20, (name, b, a)
            assert a.open_fds - b.open_fds < 16 and a.threads <= b.threads + 2, (name, b, a)
            assert a.asyncio_tasks <= b.asyncio_tasks + 4, (name, b, a)
        counts.update(faults=faults, seconds=SOAK_S, runtime_before_after={
            n: {k: [getattr(before[n], k), getattr(after[n], k)] for k in ("rss_bytes", "open_fds", "threads",
                                                                            "asyncio_tasks")} for n in SERVICES})
        record("soak", f"{SOAK_S:g} s of 4 clients with random faults (seed 1234)", counts)
    finally:
        cluster.stop()
