"""The mesh with mutual TLS and an API key (``kervan up --tls --api-key-file``), as real
processes: requests flow (the KV handoff included), and a catalog of callers the mesh
must refuse — no or wrong credentials, the wrong role, hostile sizes, counts and
leases — each gets UNAUTHENTICATED, PERMISSION_DENIED or a refusal before anything is
committed, never INTERNAL; afterwards the workers' KV is idle and requests still flow."""

from __future__ import annotations

import asyncio
import hashlib
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control_plane.cli.client import Completion, accumulate, build_request, stream
from control_plane.cli.launcher import Cluster, ClusterSpec, served_role
from kervan.engine_args import EngineArgs
from services.common.security import MeshSecurity
from services.proto import (
    common_pb2,
    kv_registry_pb2,
    kv_registry_pb2_grpc,
    router_pb2,
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
LIMITS = kv_registry_pb2.RequestLimits(max_model_len=64, max_n=1)


@pytest.fixture(scope="module")
def tls_cluster(llama, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"{KEY}\n{EXPIRED_KEY} expires=2020-01-01T00:00:00+00:00  # rotated out\n")
    # two routers and two schedulers: clients and routers reach the replicas over TLS through one
    # channel each (services/common/replicas.py), certificates checked for the first one's address
    # the registry as the k8s deploy runs it (workers may share a certificate naming no address), which
    # the shared-certificate test needs; kervan up --tls requires addresses (the test after this fixture)
    c = Cluster(ClusterSpec(llama[1], num_prefill=1, num_decode=1,
                            engine=EngineArgs(dtype="float32", num_kv_blocks=128), tls=True,
                            api_key_file=keys, registry_args=("--ttl", "2"), num_routers=2, num_schedulers=2,
                            http_port=0, require_worker_addresses=False),
                tmp_path_factory.mktemp("tls-cluster-logs"))
    c.start(timeout=240)
    assert not (c.tls_dir / "worker.pem").exists()  # kervan up issues no worker certificate naming no address
    c.authority.issue("worker")  # one such, as a stolen or k8s-wide certificate, for the tests below
    yield c
    c.stop()


def test_kervan_up_tls_has_its_registry_refuse_worker_certificates_naming_no_address(llama, tmp_path):
    flags = Cluster(ClusterSpec(llama[1], tls=True), tmp_path).registry_flags()
    assert "--require-worker-addresses" in flags
    assert "--require-worker-addresses" not in Cluster(ClusterSpec(llama[1]), tmp_path).registry_flags()


def as_role(cluster, role: str) -> MeshSecurity:
    d = cluster.tls_dir
    return MeshSecurity.from_files(str(d / f"{role}.pem"), str(d / f"{role}-key.pem"), str(d / "ca.pem"))


def dial(cluster, role: str, service: str):
    """A channel to ``service`` with ``role``'s certificate, checking the role it serves."""
    return as_role(cluster, role).channel(cluster.addresses[service], role=served_role(service))


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
    from control_plane.cli.certificates import CertificateAuthority
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
            async with security.channel(tls_cluster.addresses[service], role=served_role(service)) as ch:
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
        ("router", "kv-registry", "Match", kv_registry_pb2.MatchRequest(block_hashes=hashes), "may not call"),
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
    async with dial(tls_cluster, role, service) as ch:
        await expect(lambda: getattr(STUBS[service](ch), method)(request_, timeout=10), DENIED, words)


async def test_push_kv_is_only_from_workers_and_is_bounded_before_it_is_buffered(tls_cluster):
    digest = hashlib.sha256(b"").digest()

    def push(*messages):
        async def gen():
            for m in messages:
                yield m
        return gen()

    header = worker_pb2.KvHeader(request_id="x", num_bytes=4, dtype="float32", shape=[1], prompt_digest=digest)
    async with dial(tls_cluster, "router", "decode-0") as ch:
        await expect(lambda: worker_pb2_grpc.WorkerServiceStub(ch).PushKv(
            push(worker_pb2.PushKvRequest(header=header)), timeout=10), DENIED, "may not call")
    async with dial(tls_cluster, "worker", "decode-0") as ch:
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
    async with dial(tls_cluster, "router", "decode-0") as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        # the KV is bound to the digest of the prompt it was pushed for: another prompt cannot use it
        await expect(lambda: stub.Decode(worker_pb2.DecodeRequest(
            request_id="poison", prompt=common_pb2.TokenIds(ids=PROMPT), kv_handle=receipt.handle),
            timeout=10), INVALID, "another prompt")
        await stub.Abort(worker_pb2.AbortRequest(request_id="poison"), timeout=10)  # drops the staged KV


async def test_prefill_pushes_only_to_registered_decode_workers(tls_cluster):
    async with dial(tls_cluster, "router", "prefill-0") as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        for address in ("169.254.169.254:80", tls_cluster.addresses["scheduler"], tls_cluster.addresses["prefill-0"]):
            await expect(lambda address=address: stub.Prefill(worker_pb2.PrefillRequest(
                request_id="ssrf", prompt=common_pb2.TokenIds(ids=PROMPT), decode_address=address,
                sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=30), grpc.StatusCode.ABORTED,
                "not a registered decode")


async def test_the_registry_bounds_what_workers_send_and_keeps_fencing_tokens_private(tls_cluster):
    async with dial(tls_cluster, "admin", "kv-registry") as ch:
        listed = await kv_registry_pb2_grpc.KvRegistryServiceStub(ch).ListWorkers(
            kv_registry_pb2.ListWorkersRequest(), timeout=10)
    assert len(listed.workers) == 2 and {w.info.incarnation for w in listed.workers} == {""}
    assert {w.info.registration_nonce for w in listed.workers} == {""}  # nor what a retried Register shows
    live = listed.workers[0].info
    async with dial(tls_cluster, "worker", "kv-registry") as ch:
        stub = kv_registry_pb2_grpc.KvRegistryServiceStub(ch)
        info = kv_registry_pb2.WorkerInfo(worker_id=live.worker_id, address=live.address, role=live.role,
                                          model=live.model, block_size=16, hash_name=live.hash_name,
                                          limits=live.limits)
        await expect(lambda: stub.Register(kv_registry_pb2.RegisterRequest(worker=info), timeout=10),
                      grpc.StatusCode.ALREADY_EXISTS, "live process")
        for guess in ("", "1", "1.0", "2." + "9" * 10):  # forged heartbeats: full load would stop placements
            await expect(lambda guess=guess: stub.Heartbeat(kv_registry_pb2.HeartbeatRequest(
                worker_id=live.worker_id, incarnation=guess), timeout=10), grpc.StatusCode.FAILED_PRECONDITION,
                "re-register")
        long_id = kv_registry_pb2.WorkerInfo(worker_id="w" * 300, address="127.0.0.1:1",
                                             role=kv_registry_pb2.WORKER_ROLE_DECODE, model="m", block_size=16,
                                             hash_name=live.hash_name, limits=LIMITS)
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
    async with dial(tls_cluster, "scheduler", "kv-registry") as ch:
        await expect(lambda: kv_registry_pb2_grpc.KvRegistryServiceStub(ch).Match(kv_registry_pb2.MatchRequest(
            block_hashes=[i.to_bytes(8, "big") for i in range(70_000)]), timeout=10), EXHAUSTED, "block hashes")


async def test_after_the_catalog_kv_is_idle_and_requests_flow(tls_cluster):
    await wait_idle(tls_cluster)
    out = await ask(tls_cluster)
    assert len(out.token_ids) == 6
    await asyncio.sleep(0)
    await wait_idle(tls_cluster)


async def test_a_request_id_reused_on_another_router_touches_only_its_own_request(tls_cluster):
    """A client's request id is unique on its router only; the workers know each request by
    an id its router minted. Another tenant's request with the same id, on the other router,
    cancelled mid-stream (an abort on the one decode worker both use), leaves the first whole."""
    first = Completion()
    request = build_request(token_ids=PROMPT, max_tokens=120, temperature=0.0, ignore_eos=True, request_id="shared")
    kwargs = {"timeout": 60, "security": router_ca(tls_cluster), "api_key": KEY}
    mine = stream(tls_cluster.addresses["router"], request, **kwargs)
    accumulate(first, await anext(mine))
    other = stream(tls_cluster.addresses["router-1"], request, **kwargs)
    assert (await anext(other)).request_id == "shared"  # the client's id is what its answers carry
    await other.aclose()  # the other client goes away: its router aborts its request on the worker
    async for msg in mine:
        accumulate(first, msg)
    assert len(first.token_ids) == 120 and first.finish_reason == "length" and first.request_id == "shared"
    await wait_idle(tls_cluster)


class CapturingRouter(router_pb2_grpc.RouterServiceServicer):
    """A fake router: what it would capture of a client that trusted it."""

    def __init__(self):
        self.captured = []

    async def Generate(self, request, context):
        self.captured.append((request, context.invocation_metadata()))
        yield router_pb2.GenerateResponse(request_id="fake")


@pytest.mark.parametrize("stolen", ["worker", "decode-0", "scheduler"])
async def test_a_mesh_certificate_cannot_pose_as_the_router_or_another_role(tls_cluster, stolen):
    """A certificate of another role (a worker's, stolen) serving RouterService: a client
    built like `kervan generate --tls-ca ca.pem` fails the handshake and sends nothing (the
    key and the prompt stay with it); a router-side client that dials another role (the
    scheduler, a worker) refuses it too."""
    from services.common.server import Service, start_server
    fake = CapturingRouter()
    service = Service("kervan.v1.RouterService", lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(fake, s))
    server = await start_server([service], security=as_role(tls_cluster, stolen), public=True)
    await server.set_serving(True)
    try:
        address = f"127.0.0.1:{server.port}"
        await expect(lambda: ask_at(address, router_ca(tls_cluster)), grpc.StatusCode.UNAVAILABLE, "")
        other = "worker" if stolen == "scheduler" else "scheduler"  # a role the stolen certificate is not
        async with as_role(tls_cluster, "router").channel(address, role=other) as ch:
            await expect(lambda: scheduler_pb2_grpc.SchedulerServiceStub(ch).Place(
                scheduler_pb2.PlaceRequest(request_id="x", num_prompt_tokens=8), timeout=5),
                grpc.StatusCode.UNAVAILABLE, "")
        assert fake.captured == []
    finally:
        await server.stop(0)


async def ask_at(address: str, security: MeshSecurity) -> None:
    async for _ in stream(address, build_request(token_ids=PROMPT, max_tokens=2), timeout=5, security=security,
                          api_key=KEY):
        pass


async def test_a_worker_certificate_registers_only_its_own_address_and_one_worker(tls_cluster):
    """kervan up issues each worker a certificate naming its address: with it a compromised
    worker can neither advertise another address (and receive another worker's requests) nor
    hold another worker's id, nor register a second worker beside its own."""
    live = {w.info.role: w.info for w in (await list_workers(tls_cluster)).workers}
    decode, prefill = live[kv_registry_pb2.WORKER_ROLE_DECODE], live[kv_registry_pb2.WORKER_ROLE_PREFILL]
    d = tls_cluster.tls_dir  # decode-0's own certificate, as the launcher issued it
    stolen = MeshSecurity.from_files(str(d / "decode-0.pem"), str(d / "decode-0-key.pem"), str(d / "ca.pem"))
    async with stolen.channel(tls_cluster.addresses["kv-registry"], role="kv-registry") as ch:
        stub = kv_registry_pb2_grpc.KvRegistryServiceStub(ch)

        def register(worker_id: str, address: str, role: int = kv_registry_pb2.WORKER_ROLE_DECODE):
            info = kv_registry_pb2.WorkerInfo(worker_id=worker_id, address=address, role=role, model=decode.model,
                                              block_size=16, hash_name=decode.hash_name, limits=LIMITS)
            return stub.Register(kv_registry_pb2.RegisterRequest(worker=info), timeout=10)
        await expect(lambda: register("decode@evil", prefill.address), DENIED, "may register")
        await expect(lambda: register(prefill.worker_id, prefill.address, kv_registry_pb2.WORKER_ROLE_PREFILL), DENIED,
                     "may register")
        await expect(lambda: register("decode@other", decode.address), DENIED, "ROLE@ADDRESS")
        both = kv_registry_pb2.WORKER_ROLE_BOTH
        await expect(lambda: register(f"both@{decode.address}", decode.address, both), DENIED,
                     "holds the live registration")
    after = {w.info.worker_id for w in (await list_workers(tls_cluster)).workers}
    assert after == {decode.worker_id, prefill.worker_id}


def shared_certificate(cluster, name: str) -> MeshSecurity:
    """A worker certificate naming no address, as ``python -m control_plane.cli.certificates``
    issues the one every worker pod of the k8s deploy mounts."""
    issued = cluster.authority.issue("worker", name=name)
    return MeshSecurity.from_files(str(issued.cert), str(issued.key), str(cluster.tls_dir / "ca.pem"))


async def test_workers_that_share_an_address_less_certificate_all_serve(tls_cluster):
    """The k8s manifests mount one worker certificate in every pod: the second worker to
    register once got PERMISSION_DENIED and exited (a crash loop). Two real worker processes
    with one such certificate both register, are listed and answer."""
    issued = tls_cluster.authority.issue("worker", name="pods")
    flags = ("--tls-cert", str(issued.cert), "--tls-key", str(issued.key))  # after the launcher's own: they win
    names = []
    try:
        for _ in range(2):
            names.append(tls_cluster.add_worker("both", *flags))
        listed = {w.info.worker_id for w in (await list_workers(tls_cluster)).workers}
        ports = {tls_cluster.addresses[n] for n in names}
        assert {f"both@{a}" for a in ports} <= listed
        for name in names:
            assert tls_cluster.procs[name].poll() is None, name  # neither exited
    finally:
        for name in names:
            tls_cluster.stop_process(name)


async def test_a_retried_register_returns_the_token_only_to_the_process_that_registered(tls_cluster):
    """``Register`` with a live worker's id and nonce once returned that worker's fencing
    token (the retry path), and ``ListWorkers`` listed every nonce: anyone could take a
    worker's token. The registry now keeps the nonce's digest bound to the registering
    certificate, and lists neither."""
    address = "127.0.0.1:9"  # nothing listens: a registration only
    info = kv_registry_pb2.WorkerInfo(worker_id=f"decode@{address}", address=address,
                                      role=kv_registry_pb2.WORKER_ROLE_DECODE, model="m", block_size=16,
                                      hash_name=(await list_workers(tls_cluster)).workers[0].info.hash_name,
                                      limits=LIMITS, registration_nonce="n-0123456789abcdef")
    owner, thief = shared_certificate(tls_cluster, "owner"), shared_certificate(tls_cluster, "thief")
    async with owner.channel(tls_cluster.addresses["kv-registry"], role="kv-registry") as ch:
        stub = kv_registry_pb2_grpc.KvRegistryServiceStub(ch)
        first = await stub.Register(kv_registry_pb2.RegisterRequest(worker=info), timeout=10)
        again = await stub.Register(kv_registry_pb2.RegisterRequest(worker=info), timeout=10)
        assert again.incarnation == first.incarnation  # its own retry after a timeout: the same registration
    async with thief.channel(tls_cluster.addresses["kv-registry"], role="kv-registry") as ch:
        stub = kv_registry_pb2_grpc.KvRegistryServiceStub(ch)
        await expect(lambda: stub.Register(kv_registry_pb2.RegisterRequest(worker=info), timeout=10),
                     grpc.StatusCode.ALREADY_EXISTS, "live process")
    listed = [w.info for w in (await list_workers(tls_cluster)).workers if w.info.worker_id == info.worker_id]
    assert listed and listed[0].registration_nonce == "" and listed[0].incarnation == ""
    async with owner.channel(tls_cluster.addresses["kv-registry"], role="kv-registry") as ch:
        await kv_registry_pb2_grpc.KvRegistryServiceStub(ch).Deregister(kv_registry_pb2.DeregisterRequest(
            worker_id=info.worker_id, incarnation=first.incarnation), timeout=10)


async def list_workers(cluster) -> kv_registry_pb2.ListWorkersResponse:
    async with dial(cluster, "admin", "kv-registry") as ch:
        return await kv_registry_pb2_grpc.KvRegistryServiceStub(ch).ListWorkers(kv_registry_pb2.ListWorkersRequest(),
                                                                               timeout=10)


async def test_each_router_serves_https_with_its_public_certificate(tls_cluster):
    """The OpenAI front over HTTPS with the public certificate (checked for 127.0.0.1 with the
    mesh's CA), a key required; behind it the front dials its own router, checking that
    certificate by the first name it carries."""
    import ssl
    import urllib.error
    import urllib.request

    context = ssl.create_default_context(cafile=str(tls_cluster.tls_dir / "ca.pem"))
    body = json.dumps({"model": tls_cluster.spec.model_dir.name, "prompt": PROMPT, "max_tokens": 3,
                       "temperature": 0}).encode()

    def post(address: str, key: str | None) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        request = urllib.request.Request(f"https://{address}/v1/completions", data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30, context=context) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())
    for name in ("router", "router-1"):
        status, answer = await asyncio.to_thread(post, tls_cluster.addresses[f"{name}-http"], KEY)
        assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer
        status, _ = await asyncio.to_thread(post, tls_cluster.addresses[f"{name}-http"], None)
        assert status == 401
