"""Chaos across hosts: the faults only a network has, on a mesh over four simulated hosts
(``control_plane/hosts/``: control h0, prefill-0 on h1, decode-0 on h2, decode-1 on h3; mutual
TLS; deterministic, so a finished greedy request equals the engine alone's tokens). Each test
breaks the network with a ``tc`` filter, checks every request with the chaos checker
(contiguous indices, exactly once, greedy equality), heals, and waits for the mesh to be whole
again: every worker registered, idle, nothing left in Redis of a lease that ran out."""

from __future__ import annotations

import asyncio
import time

import pytest

from control_plane.cli.launcher import Cluster, ClusterSpec
from control_plane.cli.service_hosts import SimulatedHosts
from control_plane.hosts.link import Link
from kervan.engine_args import EngineArgs
from services.proto import kv_registry_pb2, kv_registry_pb2_grpc
from tests.chaos.checker import check, record, stream, streams_decoding_on_one_of, wait_baseline
from tests.conftest import EXACT_MESH, EXACT_REFERENCE, greedy_tokens, make_prompts
from tests.multihost.hosts import REASON

pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

WORKERS = ["prefill-0", "decode-0", "decode-1"]
TTL_S = 3  # the registry's lease: a silent worker is gone this long after its last heartbeat


@pytest.fixture(scope="module")
def mesh(llama, tmp_path_factory):
    cluster = Cluster(ClusterSpec(llama[1], num_prefill=1, num_decode=2, hosts=4, link=Link.parse("1gbit"), tls=True,
                                  engine=EngineArgs(**EXACT_MESH, num_kv_blocks=256),
                                  registry_args=("--ttl", str(TTL_S))), tmp_path_factory.mktemp("host-faults"))
    cluster.start(timeout=240)
    yield cluster
    cluster.stop()


def hosts(cluster: Cluster) -> SimulatedHosts:
    assert isinstance(cluster.service_hosts, SimulatedHosts)
    return cluster.service_hosts


async def listed(cluster: Cluster) -> set[str]:
    """The addresses of the workers the registry lists now."""
    async with cluster.client_security.channel(cluster.addresses["kv-registry"], role="kv-registry") as ch:
        reply = await kv_registry_pb2_grpc.KvRegistryServiceStub(ch).ListWorkers(kv_registry_pb2.ListWorkersRequest())
    return {w.info.address for w in reply.workers}


async def wait_listed(cluster: Cluster, address: str, present: bool, timeout: float) -> float:
    """Seconds until the registry lists (or stops listing) ``address``."""
    start = time.monotonic()
    while (address in await listed(cluster)) != present:
        assert time.monotonic() - start < timeout, f"{address} still {'un' if present else ''}listed after {timeout}s"
        await asyncio.sleep(0.2)
    return time.monotonic() - start


async def send(cluster: Cluster, prompts: list[list[int]], max_tokens: int) -> list:
    return await asyncio.gather(*[stream(cluster.router_address, p, max_tokens, timeout=90,
                                         security=cluster.client_security) for p in prompts])


def whole_again(cluster: Cluster) -> None:
    async def wait():
        for name in WORKERS:
            await wait_listed(cluster, cluster.addresses[name], True, 30)
        await wait_baseline(cluster, WORKERS, timeout=60)
    asyncio.run(wait())


def test_a_host_cut_off_mid_stream_has_its_streams_moved_and_rejoins_when_healed(mesh, llama):
    whole_again(mesh)
    prompts = make_prompts([20, 21, 22, 23], seed=201)
    max_tokens = 300
    expected = greedy_tokens(llama[1], prompts, max_tokens, **EXACT_REFERENCE)
    decoders = {mesh.addresses[n]: n for n in ("decode-0", "decode-1")}

    async def run():
        tasks, worker = await streams_decoding_on_one_of(mesh.router_address, list(decoders), prompts, max_tokens,
                                                         60, security=mesh.client_security)
        host = hosts(mesh).host_of(decoders[worker])
        hosts(mesh).network.cut(host)  # its lease is still valid for up to TTL_S
        at = time.monotonic()
        try:
            outs = await asyncio.gather(*tasks)
            gone_after = await wait_listed(mesh, worker, False, TTL_S + 10)  # ownership converges on the lease
        finally:
            hosts(mesh).network.heal(host)
        rejoined_after = await wait_listed(mesh, worker, True, 30)
        return outs, at, gone_after, rejoined_after

    outs, at, gone_after, rejoined_after = asyncio.run(run())
    counts = check(outs, expected)
    assert counts["completed"] == len(prompts) and counts["migrated"] >= 1, counts
    assert gone_after <= TTL_S + 10 and rejoined_after < 30
    whole_again(mesh)
    moved = [o.first_token_after[1] for o in outs if 1 in o.first_token_after]
    record("host_cut_off", "a decode host cut off from the network mid-stream (tc drop), healed after",
           counts, round(min(moved) - at, 3))


def test_a_link_that_drops_a_tenth_of_its_packets_slows_requests_but_loses_none(mesh, llama):
    whole_again(mesh)
    prompts = make_prompts([60, 70, 80, 90, 100, 110], seed=202)
    expected = greedy_tokens(llama[1], prompts, 24, **EXACT_REFERENCE)
    net = hosts(mesh).network
    workers = [hosts(mesh).host_of(n) for n in WORKERS]
    for host in workers:
        net.lossy(host, 0.10)
    try:
        outs = asyncio.run(send(mesh, prompts, 24))
    finally:
        for host in workers:
            net.heal(host)
    counts = check(outs, expected)
    assert counts["completed"] == len(prompts), counts
    whole_again(mesh)
    record("lossy_links", "every worker host's link dropping 10% of its packets each way", counts)


def test_a_partition_between_prefill_and_decode_hosts_during_a_kv_push_ends_every_request(mesh, llama):
    whole_again(mesh)
    prompts = make_prompts([64, 80, 96], seed=203)
    expected = greedy_tokens(llama[1], prompts, 16, **EXACT_REFERENCE)
    net = hosts(mesh).network
    prefill = hosts(mesh).host_of("prefill-0")
    decoders = [hosts(mesh).host_of(n) for n in ("decode-0", "decode-1")]
    net.partition([prefill], decoders)  # the prefill host still reaches the control host: only the push breaks
    try:
        outs = asyncio.run(send(mesh, prompts, 16))
    finally:
        net.heal(prefill)
    counts = check(outs, expected)
    # the decode workers answer the router, so the prefill host is left out and they prefill themselves
    assert counts["completed"] == len(prompts), (counts, [(o.status, o.details) for o in outs])
    whole_again(mesh)
    record("prefill_decode_partition", "prefill host and decode hosts partitioned while KV is pushed", counts)


def test_a_worker_host_cut_off_from_the_control_hosts_registry_and_redis_leaves_and_rejoins(mesh, llama):
    whole_again(mesh)
    net = hosts(mesh).network
    control = hosts(mesh).host_of("kv-registry")
    host = hosts(mesh).host_of("decode-1")
    address = mesh.addresses["decode-1"]
    for service in ("kv-registry", "redis"):
        net.block_port(host, control, int(mesh.addresses[service].rsplit(":", 1)[1]))
    prompts = make_prompts([30, 40, 50, 60], seed=204)
    expected = greedy_tokens(llama[1], prompts, 16, **EXACT_REFERENCE)
    try:
        asyncio.run(wait_listed(mesh, address, False, TTL_S + 10))  # no heartbeat lands: its lease runs out
        outs = asyncio.run(send(mesh, prompts, 16))  # placed on the workers the registry still lists
    finally:
        net.heal(host)
    counts = check(outs, expected)
    assert counts["completed"] == len(prompts), counts
    asyncio.run(wait_listed(mesh, address, True, 30))
    whole_again(mesh)
    record("registry_unreachable", "one worker host unable to reach the control host's registry and Redis",
           counts)
