"""Chaos soak: a bounded number of mixed requests while faults are injected at random
(fixed seed, reproducible): workers SIGKILLed and replaced, Redis restarted empty. Every request
must end exactly once with its fault-free tokens; the services' memory, open file
descriptors, threads and asyncio tasks (their RuntimeService) must stay flat."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter

from control_plane.cli.launcher import Cluster, ClusterSpec
from kervan.engine_args import EngineArgs
from tests.chaos.checker import check, open_fds, process_gone, record, restart_redis, runtime, stream, wait_baseline
from tests.conftest import EXACT_MESH, EXACT_REFERENCE, greedy_tokens, make_prompts

SOAK_REQUESTS = int(os.environ.get("KERVAN_SOAK_REQUESTS", "80"))
SEED = int(os.environ.get("KERVAN_SOAK_SEED", "1234"))
NUM_FAULTS = 3  # two workers SIGKILLed and replaced, one Redis restart
SERVICES = ("router", "scheduler", "kv-registry")  # the workers are replaced as the soak goes


def test_soak_with_random_faults(llama, tmp_path):
    """Reproducible from its seed: which prompts each client sends, after how many finished
    requests each fault strikes and what it is (not the wall clock, which varies by machine)."""
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=0, num_decode=0, num_both=2,
                                  engine=EngineArgs(**EXACT_MESH, num_kv_blocks=256), registry_args=("--ttl", "2"),
                                  router_args=("--stall-timeout-s", "3")), tmp_path)
    cluster.start(timeout=240)
    rng = random.Random(SEED)
    try:
        pool = make_prompts([12 + i % 11 for i in range(24)], seed=110)
        expected = greedy_tokens(llama[1], pool, 48, **EXACT_REFERENCE)
        asyncio.run(stream(cluster.router_address, pool[0], 4))  # warm-up before the baseline
        before = asyncio.run(runtime(cluster, SERVICES))
        fds_before = open_fds(cluster.procs["kv-registry"].pid)
        redis_port = cluster.addresses["redis"].rsplit(":", 1)[1]  # Redis restarts on the same port
        per_client = [[rng.randrange(len(pool)) for _ in range(SOAK_REQUESTS // 4)] for _ in range(4)]
        strike_after = sorted(rng.sample(range(SOAK_REQUESTS // 8, SOAK_REQUESTS * 7 // 8), NUM_FAULTS))
        kinds = ["kill", "kill", "redis"]  # every kind of fault, in an order drawn from the seed
        rng.shuffle(kinds)
        plan = [(kind, rng.choice(["both-0", "both-1"]) if kind == "kill" else "") for kind in kinds]
        faults: list[str] = []

        async def soak():
            outcomes, which = [], []

            async def client(k):
                for i in per_client[k]:
                    outcomes.append(await stream(cluster.router_address, pool[i], 48))
                    which.append(i)

            async def injector():
                for after, (kind, victim) in zip(strike_after, plan):
                    while len(outcomes) < after:
                        await asyncio.sleep(0.01)
                    if kind == "kill":
                        victim = sorted(n for n in cluster.procs if n.startswith("both-"))[int(victim[-1])]
                        proc = cluster.procs.pop(victim)
                        proc.kill()
                        await asyncio.to_thread(process_gone, proc)
                        faults.append(f"SIGKILL {victim} after {after} requests")
                        await asyncio.to_thread(cluster.add_worker, "both")
                    else:
                        await asyncio.to_thread(restart_redis, cluster)
                        faults.append(f"Redis restarted empty after {after} requests")

            await asyncio.gather(injector(), *(client(k) for k in range(4)))
            return outcomes, which

        outcomes, which = asyncio.run(soak())
        assert len(faults) == NUM_FAULTS
        counts = check(outcomes, [expected[i] for i in which])
        assert counts["completed"] == len(outcomes) == SOAK_REQUESTS // 4 * 4
        workers = sorted(n for n in cluster.procs if n.startswith("both-"))
        asyncio.run(wait_baseline(cluster, workers, timeout=30))
        after = asyncio.run(runtime(cluster, SERVICES))
        registry = cluster.procs["kv-registry"].pid

        def registry_sockets() -> tuple[list[str], Counter]:
            to_redis = [f for f in open_fds(registry) if f.endswith(f"->{redis_port}")]
            other = Counter(f for f in open_fds(registry) if f not in to_redis) - Counter(
                f for f in fds_before if not f.endswith(f"->{redis_port}"))
            return to_redis, other
        # the registry's Redis pool is bounded (its --redis-max-connections, 16); nothing else may grow:
        # each killed worker's connection is gone, each new worker's is there (one for one). A killed
        # worker's socket may take the registry's gRPC a moment to close on a loaded machine: 10 s
        for _ in range(50):
            to_redis, other = registry_sockets()
            if len(to_redis) <= 16 and sum(other.values()) <= 2:
                break
            time.sleep(0.2)
        assert len(to_redis) <= 16 and sum(other.values()) <= 2, (to_redis, other)
        for name in SERVICES:  # flat: no memory, file descriptors, threads or tasks left behind by faults
            b, a = before[name], after[name]
            assert a.rss_bytes - b.rss_bytes < 32 << 20, (name, b, a)
            assert a.threads <= b.threads + 2 and a.asyncio_tasks <= b.asyncio_tasks + 4, (name, b, a)
            if name != "kv-registry":  # its Redis sockets are checked above
                assert a.open_fds - b.open_fds <= 2, (name, b, a)
        counts.update(faults=faults, requests=SOAK_REQUESTS, seed=SEED, runtime_before_after={
            n: {k: [getattr(before[n], k), getattr(after[n], k)] for k in ("rss_bytes", "open_fds", "threads",
                                                                            "asyncio_tasks")} for n in SERVICES})
        record("soak", f"{SOAK_REQUESTS} requests of 4 clients with {NUM_FAULTS} random faults (seed {SEED})",
               counts)
    finally:
        cluster.stop()
