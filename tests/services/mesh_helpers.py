"""Helpers for tests against in-process meshes (``start_mesh`` in conftest.py,
``scheduled_mesh.py``): streaming a request, and waiting on what the workers report."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager

from services.proto import common_pb2, worker_pb2


def greedy(max_tokens, **kw):
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


async def collect(stub, request, timeout=60):
    deltas, finished = [], []
    async for msg in stub.Generate(request, timeout=timeout):
        (deltas if msg.WhichOneof("kind") == "delta" else finished).append(msg)
    return deltas, finished


def token_ids(deltas, sample=0):
    return [t for d in deltas if d.delta.sample_index == sample for t in d.delta.token_ids]


async def wait_idle(mesh, timeout=10.0):
    """Every worker back to no running/waiting request and all blocks free, none staged."""
    loads = None
    for _ in range(int(timeout / 0.05)):
        loads = [(await w.stub.GetLoad(worker_pb2.GetLoadRequest())).load for w in mesh.workers]
        if all(x.num_running == x.num_waiting == 0 and x.num_free_blocks == x.num_blocks for x in loads):
            return loads
        await asyncio.sleep(0.05)
    raise AssertionError(f"workers not idle: {loads}")


async def num_aborted(mesh) -> int:
    return sum([(await w.stub.GetLoad(worker_pb2.GetLoadRequest())).load.num_aborted for w in mesh.workers])


async def wait_aborted(mesh, count: int, timeout=10.0) -> None:
    """Until the workers report ``count`` aborts in all: the evidence an abort reached them."""
    for _ in range(int(timeout / 0.02)):
        if await num_aborted(mesh) >= count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the workers report {await num_aborted(mesh)} aborts, not {count}")


@contextmanager
def engine_paused(mesh):
    """Hold every worker's engine thread between two steps: no request progresses, so
    none can finish by itself while the test acts on it."""
    release = threading.Event()
    for w in mesh.workers:
        w.engine.post(lambda e: release.wait(30))
    try:
        yield
    finally:
        release.set()


async def wait_inactive(mesh, timeout=10.0) -> None:
    """Until no worker counts a request in flight (its gRPC call ended)."""
    for _ in range(int(timeout / 0.02)):
        if not any(w.engine.load().num_requests for w in mesh.workers):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("a worker still has the request in flight")
