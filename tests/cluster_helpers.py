"""Helpers for tests against the process mesh (the ``cluster`` fixture in conftest.py)."""

from __future__ import annotations

import asyncio

import grpc

from control_plane.cli.client import Completion, accumulate, build_request, stream
from control_plane.cli.launcher import served_role
from services.proto import (
    kv_registry_pb2,
    kv_registry_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)


async def complete(cluster, timeout: float = 60, **kwargs) -> Completion:
    out = Completion()
    async for msg in stream(cluster.router_address, build_request(**kwargs), timeout=timeout):
        accumulate(out, msg)
    return out


async def scheduler_stats(cluster) -> scheduler_pb2.GetStatsResponse:
    async with grpc.aio.insecure_channel(cluster.addresses["scheduler"]) as channel:
        return await scheduler_pb2_grpc.SchedulerServiceStub(channel).GetStats(scheduler_pb2.GetStatsRequest(),
                                                                                timeout=10)


async def scheduler_dry_run(cluster, prompt, block_size: int = 16) -> scheduler_pb2.PlaceResponse:
    """Where the scheduler would place ``prompt`` now, and why (counted nowhere)."""
    from kervan.block_hash import hash_blocks
    async with grpc.aio.insecure_channel(cluster.addresses["scheduler"]) as ch:
        return await scheduler_pb2_grpc.SchedulerServiceStub(ch).Place(scheduler_pb2.PlaceRequest(
            request_id="dry", block_hashes=hash_blocks(prompt, block_size), num_prompt_tokens=len(prompt),
            dry_run=True))


async def wait_cached(cluster, prompt, num_blocks, worker_id: str | None = None, timeout: float = 30.0):
    """KV events reach the registry asynchronously: wait until it sees the blocks (on
    ``worker_id``, or on any worker); ``timeout`` bounds the test on a loaded machine, not
    the registry (it sees them within the workers' event interval when idle)."""
    from kervan.block_hash import hash_blocks
    async with grpc.aio.insecure_channel(cluster.addresses["kv-registry"]) as ch:
        stub = kv_registry_pb2_grpc.KvRegistryServiceStub(ch)
        for _ in range(int(timeout / 0.05)):
            match = await stub.Match(kv_registry_pb2.MatchRequest(block_hashes=hash_blocks(prompt, 16)))
            seen = match.matched_blocks.get(worker_id, 0) if worker_id else max(match.matched_blocks.values(),
                                                                                default=0)
            if seen >= num_blocks:
                return
            await asyncio.sleep(0.05)
    raise AssertionError("registry never saw the prompt's blocks")


async def worker_loads(cluster):
    """Every worker's load, through the launcher's own credentials (an admin certificate
    on a mesh with TLS)."""
    loads = {}
    for name in [n for n in cluster.procs if n.split("-")[0] in ("prefill", "decode", "both")]:
        async with cluster.client_security.channel(cluster.addresses[name], role=served_role(name)) as ch:
            loads[name] = (await worker_pb2_grpc.WorkerServiceStub(ch).GetLoad(worker_pb2.GetLoadRequest())).load
    return loads


async def wait_idle(cluster):
    for _ in range(200):
        loads = await worker_loads(cluster)
        if all(x.num_running == x.num_waiting == 0 and x.num_free_blocks == x.num_blocks for x in loads.values()):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"workers not idle: {loads}")
