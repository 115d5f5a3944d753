"""The mesh with mutual TLS and an API key (``kervan up --tls --api-key-file``), as real
processes: requests flow (the KV handoff included), and a catalog of callers the mesh
must refuse — no or wrong credentials, the wrong role, hostile sizes, counts and
leases — each gets UNAUTHENTICATED, PERMISSION_DENIED or a refusal before anything is
committed, never INTERNAL; afterwards the workers' KV is idle and requests still flow."""

from __future__ import annotations

import asyncio
import hashlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control_plane.client import Completion, accumulate, build_request, stream
from control_plane.launcher import Cluster, ClusterSpec
from services.common.security import MeshSecurity
from services.proto import (
    common_pb2,
    kv_registry_pb2,
    kv_registry_pb2_grpc,
    router_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.cluster_helpers import wait_idle
from tests.test_bad_input import expect

KEY = "k-valid-0123456789abcdef"
EXPIRED_KEY = "k-expired-0123456789abcdef"
UNAUTHENTICATED, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
PROMPT = [5, 6, 7, 8] * 6


@pytest.fixture(scope="module")
def tls_cluster(llama, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"{KEY}\n{EXPIRED_KEY} expires=2020-01-01T00:00:00+00:00  # rotated out\n")
    # two routers and two schedulers: clients and routers reach the replicas over TLS through one
    # channel each (services/common/replicas.py), certificates checked for the first one's address
    c = Cluster(ClusterSpec(llama[1], num_prefill=1, num_decode=1, dtype="float32", num_kv_blocks=128, tls=True,
                            api_key_file=keys, registry_args=("--ttl", "2"), num_routers=2, num_schedulers=2),
                tmp_path_factory.mktemp("tls-cluster-logs"))
    c.start(timeout=240)
    yield c
    c.stop()


def as_role(cluster, role: str) -> MeshSecurity:
    d = cluster.tls_dir
    return MeshSecurity.from_files(str(d / f"{role}.pem"), str(d / f"{role}-key.pem"), str(d / "ca.pem"))


def router_ca(cluster) -> MeshSecurity:
    return MeshSecurity.from_files(None, None, str(cluster.tls_dir / "ca.pem"))


async def ask(cluster, api_key=KEY, security=None, **kwargs) -> Completion:
    out = Completion()
    request = build_request(**{"token_ids": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
                               **kwargs})
    async for msg in stream(cluster.router_addresses, request, timeout=60, security=security or router_ca(cluster),
                            api_key=api_key):
        accumulate(out, msg)
    return out


async def test_requests_flow_over_mutual_tls_with_an_api_key(tls_cluster):
    out = await ask(tls_cluster)
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    logs = (tls_cluster.log_dir / "prefill-0.log").read_text() + (tls_cluster.log_dir / "router.log").read_text()
    assert "Traceback" not in logs
    # the Redis password never reaches a command line
    for name, proc in tls_cluster.procs.items():
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert tls_cluster.redis_password.encode() not in f.read(), name


@pytest.mark.parametrize("case,api_key,words", [
    ("no key", None, "missing API key"),
    ("wrong key", "k-wrong-0123456789abcdef", "invalid API key"),
    ("expired key", EXPIRED_KEY, "expired API key"),
    ("a valid key's prefix", KEY[:-1], "invalid API key"),
])
async def test_the_router_refuses_callers_without_a_valid_key(tls_cluster, case, api_key, words):
    await expect(lambda: ask(tls_cluster, api_key=api_key), UNAUTHENTICATED, words)


async def test_health_stays_open_and_plaintext_is_refused(tls_cluster):
    async with router_ca(tls_cluster).channel(tls_cluster.router_address) as ch:  # no key, no client certificate
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    async with grpc.aio.insecure_channel(tls_cluster.router_address) as ch:
        await expect(lambda: router_pb2_grpc.RouterServiceStub(ch).Generate(build_request(token_ids=[5]), timeout=5),
                     grpc.StatusCode.UNAVAILABLE, "")


async def test_internal_services_refuse_callers_without_a_mesh_certificate(tls_cluster, tmp_path):
    from control_plane.certificates import CertificateAuthority
    foreign = CertificateAuthority(tmp_path / "foreign").issue("router")
    expired = tls_cluster.authority.issue("router", valid_days=-1, name="expired-router")
    callers = {
        "no certificate": router_ca(tls_cluster),
        "another CA's certificate": MeshSecurity.from_files(str(foreign.cert), str(foreign.key),
                                                            str(tls_cluster.tls_dir / "ca.pem")),
        "an expired certificate": MeshSecurity.from_files(str(expired.cert), str(expired.key), str(expired.ca)),
    }
    for security in callers.values():
        for service in ("decode-0", "scheduler", "kv-registry"):
            async with security.channel(tls_cluster.addresses[service]) as ch:
                await expect(lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5),
                             grpc.StatusCode.UNAVAILABLE, "")  # the TLS handshake fails: nothing is served
        async with grpc.aio.insecure_channel(tls_cluster.addresses["decode-0"]) as ch:
            await expect(lambda: worker_pb2_grpc.WorkerServiceStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5),
                         grpc.StatusCode.UNAVAILABLE, "")


def role_cases():
    hashes = [b"\1" * 32]
    return [  # (role, service, method, request, words)
        ("worker", "decode-0", "Decode", worker_pb2.DecodeRequest(request_id="x"), "may not call"),
        ("worker", "decode-0", "Abort", worker_pb2.AbortRequest(request_id="x"), "may not call"),
        ("scheduler", "decode-0", "Execute", worker_pb2.ExecuteRequest(request_id="x"), "may not call"),
        ("router", "kv-registry", "Heartbeat", kv_registry_pb2.HeartbeatRequest(worker_id="decode@x", incarnation="1"),
         "may not call"),
        ("scheduler", "kv-registry", "Deregister", kv_registry_pb2.DeregisterRequest(worker_id="w"), "may not call"),
        ("router", "kv-registry", "ListWorkers", kv_registry_pb2.ListWorkersRequest(), "may not call"),
        ("worker", "kv-registry", "Match", kv_registry_pb2.MatchRequest(block_hashes=hashes), "may not call"),
        ("worker", "scheduler", "Place", scheduler_pb2.PlaceRequest(request_id="x", num_prompt_tokens=4),
         "may not call"),
        ("control-plane", "scheduler", "GetStats", scheduler_pb2.GetStatsRequest(), "may not call"),
    ]


STUBS = {"decode-0": worker_pb2_grpc.WorkerServiceStub, "kv-registry": kv_registry_pb2_grpc.KvRegistryServiceStub,
         "scheduler": scheduler_pb2_grpc.SchedulerServiceStub}


@pytest.mark.parametrize("role,service,method,request_,words", role_cases(),
                         ids=[f"{c[0]}->{c[1]}.{c[2]}" for c in role_cases()])
async def test_each_role_calls_only_what_it_needs(tls_cluster, role, service, method, request_, words):
    async with as_role(tls_cluster, role).channel(tls_cluster.addresses[service]) as ch:
        await expect(lambda: getattr(STUBS[service](ch), method)(request_, timeout=10), DENIED, words)


async def test_push_kv_is_only_from_workers_and_is_bounded_before_it_is_buffered(tls_cluster):
    digest = hashlib.sha256(b"").digest()

    def push(*messages):
        async def gen():
            for m in messages:
                yield m
        return gen()

    header = worker_pb2.KvHeader(request_id="x", num_bytes=4, dtype="float32", shape=[1], prompt_digest=digest)
    async with as_role(tls_cluster, "router").channel(tls_cluster.addresses["decode-0"]) as ch:
        await expect(lambda: worker_pb2_grpc.WorkerServiceStub(ch).PushKv(
            push(worker_pb2.PushKvRequest(header=header)), timeout=10), DENIED, "may not call")
    async with as_role(tls_cluster, "worker").channel(tls_cluster.addresses["decode-0"]) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        huge = worker_pb2.KvHeader(request_id="x", num_bytes=3 << 30, dtype="float32", shape=[3 << 28],
                                   prompt_digest=digest)  # refused at the header: nothing allocated
        await expect(lambda: stub.PushKv(push(worker_pb2.PushKvRequest(header=huge)), timeout=10), INVALID,
                      "exceeds")
        no_digest = worker_pb2.KvHeader(request_id="x", num_bytes=4, dtype="float32", shape=[1])
        await expect(lambda: stub.PushKv(push(worker_pb2.PushKvRequest(header=no_digest)), timeout=10), INVALID,
                      "digest")
        # a real push, with a lease asked for 49 days: the receiver keeps it at most its own --kv-lease
        long_lease = worker_pb2.KvHeader(request_id="poison", num_bytes=4, dtype="float32", shape=[1],
                                         prompt_digest=hashlib.sha256(bytes(4 * len(PROMPT))).digest(),
                                         lease_ms=2**32 - 1)
        receipt = await stub.PushKv(push(worker_pb2.PushKvRequest(header=long_lease),
                                         worker_pb2.PushKvRequest(chunk=b"\0" * 4)), timeout=10)
        assert len(receipt.handle) == 32  # minted by the receiver
    async with as_role(tls_cluster, "router").channel(tls_cluster.addresses["decode-0"]) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        # the KV is bound to the digest of the prompt it was pushed for: another prompt cannot use it
        await expect(lambda: stub.Decode(worker_pb2.DecodeRequest(
            request_id="poison", prompt=common_pb2.TokenIds(ids=PROMPT), kv_handle=receipt.handle),
            timeout=10), INVALID, "another prompt")
        await stub.Abort(worker_pb2.AbortRequest(request_id="poison"), timeout=10)  # drops the staged KV


async def test_prefill_pushes_only_to_registered_decode_workers(tls_cluster):
    async with as_role(tls_cluster, "router").channel(tls_cluster.addresses["prefill-0"]) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        for address in ("169.254.169.254:80", tls_cluster.addresses["scheduler"], tls_cluster.addresses["prefill-0"]):
            await expect(lambda address=address: stub.Prefill(worker_pb2.PrefillRequest(
                request_id="ssrf", prompt=common_pb2.TokenIds(ids=PROMPT), decode_address=address,
                sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=30), grpc.StatusCode.ABORTED,
                "not a registered decode")


async def test_the_registry_bounds_what_workers_send_and_keeps_fencing_tokens_private(tls_cluster):
    async with as_role(tls_cluster, "admin").channel(tls_cluster.addresses["kv-registry"]) as ch:
        listed = await kv_registry_pb2_grpc.KvRegistryServiceStub(ch).ListWorkers(
            kv_registry_pb2.ListWorkersRequest(), timeout=10)
    assert len(listed.workers) == 2 and {w.info.incarnation for w in listed.workers} == {""}
    live = listed.workers[0].info
    async with as_role(tls_cluster, "worker").channel(tls_cluster.addresses["kv-registry"]) as ch:
        stub = kv_registry_pb2_grpc.KvRegistryServiceStub(ch)
        info = kv_registry_pb2.WorkerInfo(worker_id=live.worker_id, address=live.address, role=live.role,
                                          model=live.model, block_size=16, hash_name=live.hash_name,
                                          max_model_len=live.max_model_len, max_n=live.max_n)
        await expect(lambda: stub.Register(kv_registry_pb2.RegisterRequest(worker=info), timeout=10),
                      grpc.StatusCode.ALREADY_EXISTS, "live process")
        for guess in ("", "1", "1.0", "2." + "9" * 10):  # forged heartbeats: full load would stop placements
            await expect(lambda guess=guess: stub.Heartbeat(kv_registry_pb2.HeartbeatRequest(
                worker_id=live.worker_id, incarnation=guess), timeout=10), grpc.StatusCode.FAILED_PRECONDITION,
                "re-register")
        long_id = kv_registry_pb2.WorkerInfo(worker_id="w" * 300, address="127.0.0.1:1", role="decode", model="m",
                                             block_size=16, hash_name=live.hash_name, max_model_len=64, max_n=1)
        await expect(lambda: stub.Register(kv_registry_pb2.RegisterRequest(worker=long_id), timeout=10), INVALID,
                      "at most 256")
        events = [kv_registry_pb2.KvEvent(seq=i + 1, cleared=kv_registry_pb2.AllBlocksCleared()) for i in range(5000)]
        await expect(lambda: stub.PublishEvents(kv_registry_pb2.PublishEventsRequest(
            worker_id=live.worker_id, events=events), timeout=10), EXHAUSTED, "events")
        many = kv_registry_pb2.TierBlocks(block_hashes=[i.to_bytes(32, "big") for i in range(300_000)])
        await expect(lambda: stub.ReportBlocks(kv_registry_pb2.ReportBlocksRequest(
            worker_id=live.worker_id, tiers=[many]), timeout=30), EXHAUSTED, "block hashes")
        fat = kv_registry_pb2.KvEvent(seq=1, stored=kv_registry_pb2.BlockStored(block_hashes=[b"x" * 65]))
        await expect(lambda: stub.PublishEvents(kv_registry_pb2.PublishEventsRequest(
            worker_id=live.worker_id, events=[fat]), timeout=10), INVALID, "block hash is")
    async with as_role(tls_cluster, "scheduler").channel(tls_cluster.addresses["kv-registry"]) as ch:
        await expect(lambda: kv_registry_pb2_grpc.KvRegistryServiceStub(ch).Match(kv_registry_pb2.MatchRequest(
            block_hashes=[i.to_bytes(8, "big") for i in range(70_000)]), timeout=10), EXHAUSTED, "block hashes")


async def test_after_the_catalog_kv_is_idle_and_requests_flow(tls_cluster):
    await wait_idle(tls_cluster)
    out = await ask(tls_cluster)
    assert len(out.token_ids) == 6
    await asyncio.sleep(0)
    await wait_idle(tls_cluster)
