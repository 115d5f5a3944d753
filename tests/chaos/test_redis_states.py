"""Chaos: Redis in the states an operator meets without it going down — full (OOM, no
eviction), busy in a script past its limit (BUSY), and reached by the control plane as a
least-privilege ACL user (no CONFIG) — with greedy streams running. The registry answers
UNAVAILABLE in the first two (never INTERNAL), the scheduler places on its last view of
the workers, and every request completes with its fault-free tokens; the lease watch under
the ACL user still has a killed worker purged (by the reconciliation loop) and never
crash-loops. Each is a scenario in the chaos report."""

from __future__ import annotations

import asyncio
import signal
import time

import redis.asyncio as redis

from control_plane.cli.launcher import Cluster, ClusterSpec
from kervan.engine_args import EngineArgs
from tests.chaos.checker import check, record, stream, wait_baseline
from tests.conftest import EXACT_MESH, EXACT_REFERENCE, greedy_tokens, make_prompts

MAX_TOKENS = 60


async def streams_through(cluster, prompts: list[list[int]], fault, clear) -> list:
    """Every prompt streamed while ``fault()`` holds Redis in its state; ``clear()`` after."""
    await fault()
    try:
        return await asyncio.gather(*(stream(cluster.router_address, p, MAX_TOKENS) for p in prompts))
    finally:
        await clear()


async def _nothing() -> None:
    pass


def test_redis_full_or_busy_and_a_least_privilege_lease_watch_lose_nothing(llama, tmp_path):
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=0, num_decode=0, num_both=2,
                                  engine=EngineArgs(**EXACT_MESH, num_kv_blocks=256),
                                  registry_args=("--ttl", "5")), tmp_path)
    cluster.start(timeout=240)
    try:
        prompts = make_prompts([20 + i for i in range(6)], seed=170)
        expected = greedy_tokens(llama[1], prompts, MAX_TOKENS, **EXACT_REFERENCE)

        async def full_and_busy() -> tuple[dict, dict]:
            admin, blocker = redis.Redis.from_url(cluster.redis_url), redis.Redis.from_url(cluster.redis_url)
            try:
                async def oom():
                    await admin.config_set("maxmemory-policy", "noeviction")
                    await admin.config_set("maxmemory", 1)

                async def no_limit():
                    await admin.config_set("maxmemory", 0)
                full = check(await streams_through(cluster, prompts, oom, no_limit), expected)
                script: list[asyncio.Task] = []

                async def busy():
                    # lua-time-limit: Redis 6.2's name (the bundled server's) for what Redis 7 calls
                    # busy-reply-threshold and still accepts as an alias
                    await admin.config_set("lua-time-limit", 10)
                    script.append(asyncio.create_task(blocker.eval("while true do end", 0)))
                    await asyncio.sleep(0.2)

                async def kill_script():
                    await asyncio.sleep(1.0)  # a busy Redis a while longer than the streams need to start
                    await admin.script_kill()
                    await asyncio.gather(*script, return_exceptions=True)
                    await admin.config_set("lua-time-limit", 5000)
                stuck = check(await streams_through(cluster, prompts, busy, kill_script), expected)
                return full, stuck
            finally:
                await admin.aclose()
                await blocker.aclose()

        full, stuck = asyncio.run(full_and_busy())
        for counts in (full, stuck):
            assert counts["completed"] == len(prompts) and counts["lost"] == 0, counts
        registry_log = (cluster.log_dir / "kv-registry.log").read_text()
        assert "INTERNAL" not in registry_log and "Traceback" not in registry_log
        record("redis_oom", "Redis full (maxmemory, noeviction) while greedy streams start", full)
        record("redis_busy", "Redis busy in a script past lua-time-limit while greedy streams start", stuck)
        asyncio.run(wait_baseline(cluster, ["both-0", "both-1"], timeout=60))

        # the lease watch again, as an ACL user without CONFIG (the README's advice)
        async def limited_user() -> str:
            admin = redis.Redis.from_url(cluster.redis_url)
            try:
                await admin.execute_command("ACL", "SETUSER", "kervan-watch", "on", ">watch-pw-0123456789",
                                            "~kervan:*", "&*", "+@all", "-@dangerous")
            finally:
                await admin.aclose()
            return cluster.redis_url.replace(f"redis://:{cluster.redis_password}@",
                                             "redis://kervan-watch:watch-pw-0123456789@")
        url = asyncio.run(limited_user())
        cluster.procs["control-plane"].send_signal(signal.SIGTERM)
        cluster.procs["control-plane"].wait()
        cluster._launch["control-plane"][1]["KERVAN_CONTROL_PLANE_REDIS"] = url
        cluster.restart_crashed(now=float("inf"))
        log = cluster.log_dir / "control-plane.log"
        deadline = time.monotonic() + 60
        while "cannot turn on Redis keyspace notifications" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        killed_at = time.monotonic()
        cluster.procs["both-1"].send_signal(signal.SIGKILL)
        cluster.procs["both-1"].wait()

        async def purged() -> float:  # the scheduler places nothing meanwhile: the lease watch lists workers
            raw = redis.Redis.from_url(cluster.redis_url)
            try:
                while len(members := await raw.smembers("kervan:workers")) != 1:
                    assert time.monotonic() - killed_at < 30, members
                    await asyncio.sleep(0.2)
                return time.monotonic() - killed_at
            finally:
                await raw.aclose()
        took = asyncio.run(purged())
        assert cluster.procs["control-plane"].poll() is None  # no crash loop
        survivors = asyncio.run(streams_through(cluster, prompts, _nothing, _nothing))
        counts = check(survivors, expected)
        record("lease_watch_least_privilege_user", "the lease watch as an ACL user without CONFIG; a worker "
               "SIGKILLed is purged by its reconciliation loop", counts, round(took, 3))
    finally:
        cluster.stop()
