"""``kervan up --api-key-file`` without ``--tls``: the key guards the router, and a mesh
secret (made by the launcher, in each service's environment) guards everything else. A
local caller without it — another user on the host, a compromised client — gets
UNAUTHENTICATED from every internal service: no tokens from a worker, no placement, no
fake worker registered. Health stays open (probes)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from control_plane.cli.client import Completion, accumulate, build_request, stream
from control_plane.cli.launcher import Cluster, ClusterSpec
from kervan.engine_args import EngineArgs
from services.common.security import MESH_SECRET_METADATA
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
from tests.test_bad_input import expect

KEY = "k-secret-mesh-0123456789"
OTHER_KEY = "k-other-tenant-0123456789"


@pytest.fixture(scope="module")
def keyed_cluster(llama, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"{KEY}\n{OTHER_KEY}\n")
    c = Cluster(ClusterSpec(llama[1], num_prefill=0, num_decode=0, num_both=1,
                            engine=EngineArgs(dtype="float32", num_kv_blocks=64),
                            api_key_file=keys, router_args=()),
                tmp_path_factory.mktemp("keyed-cluster-logs"))
    c.start(timeout=240)
    yield c
    c.stop()


KEYLESS = [  # (service, stub, method, request)
    ("both-0", worker_pb2_grpc.WorkerServiceStub, "Execute",
     worker_pb2.ExecuteRequest(request_id="x", prompt=common_pb2.TokenIds(ids=[5, 6, 7]),
                               sampling=common_pb2.SamplingParams(max_tokens=2))),
    ("both-0", worker_pb2_grpc.WorkerServiceStub, "GetLoad", worker_pb2.GetLoadRequest()),
    ("scheduler", scheduler_pb2_grpc.SchedulerServiceStub, "Place",
     scheduler_pb2.PlaceRequest(request_id="x", num_prompt_tokens=8)),
    ("kv-registry", kv_registry_pb2_grpc.KvRegistryServiceStub, "ListWorkers", kv_registry_pb2.ListWorkersRequest()),
    ("kv-registry", kv_registry_pb2_grpc.KvRegistryServiceStub, "Register",
     kv_registry_pb2.RegisterRequest(worker=kv_registry_pb2.WorkerInfo(worker_id="decode@127.0.0.1:1",
                                                                       address="127.0.0.1:1",
                                                                       role=kv_registry_pb2.WORKER_ROLE_DECODE))),
]


@pytest.mark.parametrize("service,stub,method,request_", KEYLESS, ids=[f"{c[0]}.{c[2]}" for c in KEYLESS])
async def test_internal_services_refuse_local_callers_without_the_mesh_secret(keyed_cluster, service, stub, method,
                                                                              request_):
    async with grpc.aio.insecure_channel(keyed_cluster.addresses[service]) as ch:
        for metadata in (None, [(MESH_SECRET_METADATA, "a-guess-" * 8)], [("authorization", f"Bearer {KEY}")]):
            await expect(lambda m=metadata: getattr(stub(ch), method)(request_, timeout=10, metadata=m),
                         grpc.StatusCode.UNAUTHENTICATED, "mesh's credential")
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_requests_flow_with_the_key_and_the_secret_stays_off_command_lines(keyed_cluster):
    out = Completion()
    request = build_request(token_ids=[5, 6, 7, 8], max_tokens=4, temperature=0.0, ignore_eos=True)
    async for msg in stream(keyed_cluster.router_address, request, timeout=60, api_key=KEY):
        accumulate(out, msg)
    assert len(out.token_ids) == 4
    async with grpc.aio.insecure_channel(keyed_cluster.addresses["both-0"]) as ch:  # the secret opens the door
        load = await worker_pb2_grpc.WorkerServiceStub(ch).GetLoad(
            worker_pb2.GetLoadRequest(), timeout=10, metadata=[(MESH_SECRET_METADATA, keyed_cluster.mesh_secret)])
        assert load.load.num_blocks > 0
    for name, proc in keyed_cluster.procs.items():
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert keyed_cluster.mesh_secret.encode() not in f.read(), name


async def test_with_keys_a_tenant_never_hits_another_tenants_prefix_cache(keyed_cluster):
    """With API keys, by default: the same prompt under one key is cached for that key only,
    however the header spells the key."""
    async def cached(api_key: str, header: str = "Bearer {}") -> int:
        out = Completion()
        request = build_request(token_ids=list(range(5, 53)), max_tokens=1, temperature=0.0)
        async with grpc.aio.insecure_channel(keyed_cluster.router_address) as ch:
            async for msg in router_pb2_grpc.RouterServiceStub(ch).Generate(
                    request, timeout=60, metadata=[("authorization", header.format(api_key))]):
                accumulate(out, msg)
        return out.usage["cached_prompt_tokens"]
    assert await cached(KEY) == 0
    assert await cached(KEY, "bearer  {}") >= 32  # its own prompt, again, however spelled: cached
    assert await cached(OTHER_KEY) == 0  # another tenant's: not
    assert await cached(OTHER_KEY) >= 32
