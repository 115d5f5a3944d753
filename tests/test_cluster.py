"""The whole mesh as real processes: redis-server, kv-registry, scheduler, a
prefill and a decode worker, and the router, started by the same launcher as
``kervan up``, on loopback."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control_plane.cli.client import build_request
from tests.cluster_helpers import complete, scheduler_dry_run, scheduler_stats, wait_cached, wait_idle, worker_loads
from tests.conftest import hf_greedy, make_engine, make_prompts
from worker import SamplingParams

SERVICES = {"router": "kervan.v1.RouterService", "scheduler": "kervan.v1.SchedulerService",
            "kv-registry": "kervan.v1.KvRegistryService", "prefill-0": "kervan.v1.WorkerService",
            "decode-0": "kervan.v1.WorkerService", "decode-1": "kervan.v1.WorkerService"}


async def test_disaggregated_greedy_equals_engine_and_transformers(cluster, llama):
    hf, path = llama
    prompt = make_prompts([45], seed=40)[0]  # 2 full blocks of 16, all uncached: prefilled remotely
    out = await complete(cluster, token_ids=prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    [alone] = make_engine(path).generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert out.token_ids == alone.token_ids == hf_greedy(hf, prompt, 12)
    assert out.finish_reason == "length" and out.usage["completion_tokens"] == 12
    # a second request sharing the prefix is served from cached blocks
    await wait_cached(cluster, prompt, 2)
    second = prompt[:40] + [9, 8, 7]
    out2 = await complete(cluster, token_ids=second, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert out2.usage["cached_prompt_tokens"] == 32
    assert out2.token_ids == hf_greedy(hf, second, 6)
    await wait_idle(cluster)


async def test_32_concurrent_streams_finish_with_their_lengths(cluster):
    prompts = make_prompts([8 + (i * 7) % 50 for i in range(32)], seed=41)
    outs = await asyncio.gather(*(complete(cluster, token_ids=p, max_tokens=4 + i % 9, temperature=0.0,
                                           ignore_eos=True) for i, p in enumerate(prompts)))
    assert [len(o.token_ids) for o in outs] == [4 + i % 9 for i in range(32)]
    assert all(o.finish_reason == "length" for o in outs)
    await wait_idle(cluster)


async def test_cancel_mid_stream_aborts_on_the_worker_and_frees_its_kv(cluster):
    prompt = make_prompts([60], seed=42)[0]
    before = sum(x.num_aborted for x in (await worker_loads(cluster)).values())
    async with grpc.aio.insecure_channel(cluster.router_address) as ch:
        from services.proto import router_pb2_grpc
        # far more tokens than it makes before the cancel arrives: finishing alone is no way out
        call = router_pb2_grpc.RouterServiceStub(ch).Generate(
            build_request(token_ids=prompt, max_tokens=440, temperature=0.0, ignore_eos=True))
        got = 0
        async for msg in call:
            got += len(msg.delta.token_ids)
            if got >= 4:
                break
        # cancelled at once: on a slow CPU a look at the workers' loads first let it finish its 440
        call.cancel()
    for _ in range(200):  # the worker reports the abort
        loads = await worker_loads(cluster)
        if sum(x.num_aborted for x in loads.values()) == before + 1:
            break
        await asyncio.sleep(0.05)
    assert sum(x.num_aborted for x in loads.values()) == before + 1, loads
    assert all(x.num_running == 0 for x in loads.values())
    await wait_idle(cluster)


_RUNS = itertools.count()


async def test_a_shared_prefix_is_placed_on_the_decode_worker_that_caches_it(cluster):
    """Two decode workers: the KV-aware policy sends every request sharing a prefix to the
    one that holds it (round robin or random would not), and prefills an uncached long
    prompt on the prefill worker."""
    decoders = {f"decode@{cluster.addresses[n]}": n for n in ("decode-0", "decode-1")}
    # 4 full blocks of 16, none cached anywhere: a new prompt for each run of the test (a rerun
    # shares the module's cluster, where the last run's prompt is cached)
    prompt = make_prompts([70], seed=43 + 1000 * next(_RUNS))[0]
    before = await scheduler_stats(cluster)
    out = await complete(cluster, token_ids=prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
    first = await scheduler_stats(cluster)
    assert out.usage["cached_prompt_tokens"] == 0
    assert first.by_prefill_reason["remote"] == before.by_prefill_reason["remote"] + 1  # prefilled remotely
    [holder] = [w for w in decoders if first.by_worker[w] == before.by_worker[w] + 1]
    await wait_cached(cluster, prompt, 4, holder)  # the pushed KV is cached on the decode worker too
    choices = []
    for k in range(4):
        shared = prompt[:64] + [3 + k, 4 + k]
        # the request just finished counts on the holder until its load report (at most every
        # 0.1 s) reaches the scheduler: until then the idle other one can cost less. Wait for
        # the report, not a fixed time (round robin or random would still split the four)
        for _ in range(100):
            placed = await scheduler_dry_run(cluster, shared)  # what the scheduler would do, and why
            if placed.decode_worker_id == holder:
                break
            await asyncio.sleep(0.05)
        choices.append((placed.decode_worker_id, placed.prefill_reason, dict(placed.scores)))
        out = await complete(cluster, token_ids=shared, max_tokens=2, temperature=0.0, ignore_eos=True)
        assert out.usage["cached_prompt_tokens"] == 64, k
    after = await scheduler_stats(cluster)
    # all four on the worker holding the prefix
    assert after.by_worker[holder] == first.by_worker[holder] + 4, (holder, choices, await worker_loads(cluster))
    assert after.by_prefill_reason["short"] == first.by_prefill_reason["short"] + 4  # nothing left to ship
    await wait_idle(cluster)


def test_the_services_that_run_no_model_never_load_torch(cluster):
    """Running, after serving requests: no torch library mapped into the router, the
    scheduler, the kv-registry or the lease watch (``test_torch_free.py`` checks imports)."""
    from tests.test_torch_free import torch_mapped
    names = ["router", "scheduler", "kv-registry", "control-plane"]
    assert {name: torch_mapped(cluster.procs[name].pid) for name in names} == {name: [] for name in names}
    assert torch_mapped(cluster.procs["prefill-0"].pid)  # a worker does: the check sees torch where it is


def test_generic_reflection_client_sees_every_service_serving(cluster):
    from grpc_requests import Client
    for name, service in SERVICES.items():
        client = Client.get_by_endpoint(cluster.addresses[name])
        assert service in client.service_names and "grpc.health.v1.Health" in client.service_names
        health = client.request("grpc.health.v1.Health", "Check", {"service": ""})
        assert health["status"] == "SERVING", name
        with grpc.insecure_channel(cluster.addresses[name]) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING


async def test_the_openai_http_front_serves_the_cluster(cluster, llama):
    """`kervan up --http-port`: the real openai client, token ids in (the test model has no
    tokenizer), one process's greedy tokens out, through the disaggregated mesh."""
    import openai
    prompt = make_prompts([40], seed=44)[0]
    [alone] = make_engine(llama[1]).generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                                      logprobs=True))
    async with openai.AsyncOpenAI(base_url=f"http://{cluster.addresses['router-http']}/v1", api_key="none",
                                  max_retries=0) as client:
        [model] = (await client.models.list()).data
        out = await client.completions.create(model=model.id, prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                              extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == 40 and out.usage.completion_tokens == 8
    logprobs = out.choices[0].logprobs  # without a tokenizer a token's text is its id
    assert logprobs.tokens == [str(t) for t in alone.token_ids]
    assert logprobs.token_logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    await wait_idle(cluster)


def scrape(address: str) -> str:
    import urllib.request
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return response.read().decode()


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a /metrics text (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


async def test_every_service_serves_prometheus_metrics_that_move_with_traffic(cluster):
    """`kervan up --metrics`: each service's /metrics parses, counts one request's way through
    and, where Prometheus's `promtool` is on the PATH (no PyPI package ships it), passes
    `promtool check metrics`."""
    import shutil
    import subprocess
    names = ["router", "scheduler", "kv-registry", "control-plane", "prefill-0", "decode-0", "decode-1"]
    before = {n: await asyncio.to_thread(scrape, cluster.addresses[f"{n}-metrics"]) for n in names}
    prompt = make_prompts([45], seed=45)[0]  # uncached: prefilled remotely, its KV pushed to a decode worker
    out = await complete(cluster, token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert out.usage["completion_tokens"] == 6
    with pytest.raises(grpc.aio.AioRpcError):  # a client mistake: counted by method and status
        await complete(cluster, token_ids=[1, 10**6], max_tokens=2)
    await wait_idle(cluster)
    after = {n: await asyncio.to_thread(scrape, cluster.addresses[f"{n}-metrics"]) for n in names}

    def moved(service: str, name: str, **labels: str) -> float:
        return sample(after[service], name, **labels) - sample(before[service], name, **labels)

    assert moved("router", "kervan_generation_tokens_total") == 6
    assert moved("router", "kervan_prompt_tokens_total") == 45
    assert moved("router", "kervan_time_to_first_token_seconds_count") == 1
    assert moved("router", "kervan_inter_token_latency_seconds_count") == 5
    assert moved("router", "kervan_request_success_total", finished_reason="length") == 1
    assert moved("scheduler", "kervan_placements_total", reason="remote") == 1
    assert moved("router", "kervan_rpc_errors_total", method="/kervan.v1.RouterService/Generate",
                 code="INVALID_ARGUMENT") == 1
    assert moved("kv-registry", "kervan_redis_round_trips_total") > 0
    assert moved("prefill-0", "kervan_prefix_cache_queries_total") == 45
    assert moved("prefill-0", "kervan_request_queue_time_seconds_count") == 1
    # the decode worker's engine ran at least one step per token after the first (prefill's one step counts too)
    assert sum(moved(d, "kervan_engine_step_seconds_count") for d in ("decode-0", "decode-1")) >= 5
    assert moved("prefill-0", "kervan_engine_step_seconds_count") >= 1
    assert moved("prefill-0", "kervan_kv_transfer_bytes_total", direction="pushed") > 0
    assert sum(moved(d, "kervan_kv_transfer_bytes_total", direction="received") for d in ("decode-0", "decode-1")) \
        == moved("prefill-0", "kervan_kv_transfer_bytes_total", direction="pushed")
    assert sample(after["decode-0"], "kervan_kv_cache_usage_perc") >= 0
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("the metrics counted right; `promtool check metrics` was not run: no promtool on the PATH "
                    "(Prometheus's own linter: Debian's `prometheus` package, or a Prometheus release)")
    for name, text in after.items():
        check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, f"{name}: {check.stdout}{check.stderr}"
