"""Chaos: every single process of the control path killed or starved, while greedy streams
run through a client that knows both routers. One cluster of two routers, two
schedulers, a kv-registry behind a TCP proxy to Redis, and two workers; in turn:

- SIGKILL of a router: calls it had not answered go to the other router by the
  client's retry policy; streams it was serving end UNAVAILABLE and the client asks
  again (a retry it sees); the other router's OpenAI HTTP front answers;
- SIGKILL of a scheduler: the routers' placements go to the other one, unseen;
- SIGKILL of the kv-registry, restarted (its state is Redis's): placement runs on the
  last live set meanwhile, and the workers register again and re-send their blocks;
- Redis slowed (every chunk 3 s late), then partitioned (blackholed): the registry's
  Redis calls time out, the scheduler places on its last view.

Each phase: nothing lost, every answer the fault-free greedy one, no duplicate token,
KV, Redis keys and /dev/shm back to baseline, and the fault-to-recovery time in the
chaos report."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc

from control_plane.cli.client import build_request, stream
from control_plane.cli.launcher import Cluster, ClusterSpec
from kervan.engine_args import EngineArgs
from tests.chaos.checker import Outcome, check, record, wait_baseline
from tests.chaos.fault_proxy import FaultProxy
from tests.chaos.test_network_faults import ProxyThread
from tests.conftest import EXACT_MESH, EXACT_REFERENCE, greedy_tokens, make_prompts
from tests.test_cluster import sample, scrape

MAX_TOKENS = 400
WORKERS = ["both-0", "both-1"]


async def resilient(addresses: str, prompt: list[int], started: list[float]) -> Outcome:
    """One greedy request through every router; asked again (from the start) when a router
    dies mid-stream. The outcome holds the attempt that completed; ``retries`` the others."""
    out = Outcome()
    for attempt in range(4):
        out.deltas, out.status, out.details, out.finished = [], None, "", 0
        request = build_request(token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        index = 0
        try:
            async for msg in stream(addresses, request, timeout=90):
                if msg.WhichOneof("kind") == "delta":
                    started.append(time.monotonic())
                    out.deltas.append((0, index, list(msg.delta.token_ids)))
                    index += len(msg.delta.token_ids)
                else:
                    out.finished += 1
            out.retries = attempt
            return out
        except grpc.aio.AioRpcError as err:
            out.status, out.details = err.code(), err.details() or ""
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                return out
            await asyncio.sleep(0.2)
    return out


def phase(cluster, prompts, expected, fault, name: str, wait_s: float = 0.2) -> dict:
    """Streams through both routers; ``fault()`` once they run; returns the counts."""
    async def run():
        tokens_at: list[float] = []
        tasks = [asyncio.create_task(resilient(cluster.router_addresses, p, tokens_at)) for p in prompts]
        while len(tokens_at) < len(prompts):  # every stream under way
            await asyncio.sleep(0.05)
        await asyncio.sleep(wait_s)
        at = time.monotonic()
        await asyncio.to_thread(fault)
        late = [asyncio.create_task(resilient(cluster.router_addresses, p, tokens_at)) for p in prompts[:2]]
        outs = await asyncio.gather(*tasks, *late)
        recovered = min((t for t in tokens_at if t > at), default=None)
        return outs, None if recovered is None else round(recovered - at, 3)

    outs, recovery = asyncio.run(run())
    counts = check(outs, expected + expected[:2])
    counts["client_retries"] = sum(getattr(o, "retries", 0) for o in outs)
    assert counts["completed"] == len(outs) and counts["lost"] == 0 and counts["duplicate_tokens"] == 0, counts
    asyncio.run(wait_baseline(cluster, WORKERS, timeout=60))
    record(f"control_plane_{name}", fault.__doc__, {k: v for k, v in counts.items() if k != "client_retries"},
           recovery)
    return counts


async def http_front_answers(address: str, prompts: list[list[int]], expected: list[list[int]]) -> dict:
    """Each prompt once through an HTTP front (the openai client): its greedy tokens are the
    fault-free ones (without a tokenizer a token's text is its id)."""
    import openai
    async with openai.AsyncOpenAI(base_url=f"http://{address}/v1", api_key="none", max_retries=0) as client:
        [model] = (await client.models.list()).data
        outs = await asyncio.gather(*(client.completions.create(
            model=model.id, prompt=p, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True}) for p in prompts))
    got = [[int(t) for t in out.choices[0].logprobs.tokens] for out in outs]
    assert got == expected
    return {"sent": len(prompts), "completed": len(got), "migrated": 0, "failed_as_intended": 0, "lost": 0,
            "duplicate_tokens": 0}


def test_any_single_control_process_can_die_or_starve_and_nothing_is_lost(llama, tmp_path):
    spec = ClusterSpec(llama[1], num_prefill=0, num_decode=0, num_both=2,
                       engine=EngineArgs(**EXACT_MESH, num_kv_blocks=256),
                       num_routers=2, num_schedulers=2, registry_args=("--ttl", "2"), metrics=True,
                       http_port=0)
    cluster = Cluster(spec, tmp_path)
    cluster.start(timeout=240)
    proxies = ProxyThread()
    try:
        prompts = make_prompts([20 + i for i in range(6)], seed=150)
        expected = greedy_tokens(llama[1], prompts, MAX_TOKENS, **EXACT_REFERENCE)

        def kill_router():
            """SIGKILL of a router serving streams (clients list both)"""
            # the workers pause while the busier router is chosen and killed: a stream it counts
            # then cannot end first (on a loaded machine a 400-token stream lasts well under 1 s)
            for name in WORKERS:
                cluster.procs[name].send_signal(signal.SIGSTOP)
            try:
                in_flight = {name: sample(scrape(cluster.addresses[f"{name}-metrics"]),
                                          "kervan_num_requests_in_flight") for name in ["router", "router-1"]}
                busiest = max(in_flight, key=in_flight.get)
                assert in_flight[busiest] >= 1, in_flight
                cluster.procs[busiest].send_signal(signal.SIGKILL)
                cluster.procs[busiest].wait()
            finally:
                for name in WORKERS:
                    cluster.procs[name].send_signal(signal.SIGCONT)
        counts = phase(cluster, prompts, expected, kill_router, "router_sigkill", wait_s=0.0)
        assert counts["client_retries"] >= 1  # streams on the dead router were asked again, elsewhere
        survivor = next(name for name in ("router", "router-1") if cluster.procs[name].poll() is None)
        http_counts = asyncio.run(http_front_answers(cluster.addresses[f"{survivor}-http"], prompts, expected))
        record("control_plane_router_sigkill_http", "SIGKILL of a router: the other router's OpenAI HTTP front "
               "answers (every router serves HTTP)", http_counts)

        def kill_scheduler():
            """SIGKILL of a scheduler (routers list both)"""
            cluster.procs["scheduler"].send_signal(signal.SIGKILL)
        counts = phase(cluster, prompts, expected, kill_scheduler, "scheduler_sigkill")
        assert counts["client_retries"] == 0  # placements went to the other scheduler, unseen

        redis_port = int(cluster.redis_url.rsplit(":", 1)[1].split("/")[0])
        proxy = proxies.call(FaultProxy(redis_port).start())

        def kill_registry():
            """SIGKILL of the kv-registry, restarted 2 s later (behind a proxy to Redis)"""
            cluster.procs["kv-registry"].send_signal(signal.SIGKILL)
            cluster.procs["kv-registry"].wait()
            time.sleep(2)
            env = cluster._launch["kv-registry"][1]
            env["KERVAN_KV_REGISTRY_REDIS"] = cluster.redis_url.replace(f":{redis_port}/", f":{proxy.port}/")
            cluster.restart_crashed(now=float("inf"))
            cluster._wait_serving(["kv-registry"], 60)
        phase(cluster, prompts, expected, kill_registry, "registry_sigkill")

        def slow_redis():
            """Redis 3 s late on every reply to the kv-registry, for 6 s"""
            proxy.delay_s, proxy.mode = 3.0, "delay"
            time.sleep(6)
            proxy.mode = "pass"
        phase(cluster, prompts, expected, slow_redis, "redis_slow")

        def partition_redis():
            """Redis cut off from the kv-registry (blackholed) for 6 s"""
            proxy.mode = "blackhole"
            time.sleep(6)
            proxies.call(proxy.reset)
            proxy.mode = "pass"
        phase(cluster, prompts, expected, partition_redis, "redis_partition")
    finally:
        cluster.stop()
        proxies.call(proxy.stop()) if "proxy" in locals() else None
        proxies.close()
