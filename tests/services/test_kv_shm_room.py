"""A prefill worker with too little shared memory for a request's KV (Docker's default
``/dev/shm`` is 64 MiB): the push goes by the gRPC stream, counted, and the request is
answered as with room; nothing is left in ``/dev/shm``. Without the reservation the copy
into a segment tmpfs cannot back dies of SIGBUS."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys

import pytest

from services.proto import common_pb2, router_pb2
from services.worker import kv_transfer, metrics
from tests.chaos.checker import record
from tests.services.conftest import start_mesh
from tests.services.mesh_helpers import collect, greedy, token_ids, wait_idle

SMALL_SHM = """
import torch
from services.worker.kv_transfer import SharedMemoryExport, SharedMemoryFull
try:
    SharedMemoryExport(torch.ones(4 << 20, dtype=torch.uint8))  # 4 MiB into a 1 MiB /dev/shm
except SharedMemoryFull as full:
    print("full:", full)
"""


def own_segments() -> list[str]:
    return [n for n in os.listdir(kv_transfer.SHM_DIR) if n.startswith(f"{kv_transfer.SHM_PREFIX}{os.getpid()}-")]


def can_mount_a_private_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not can_mount_a_private_tmpfs(), reason="mounting a private tmpfs needs unshare -m (root)")
def test_a_segment_larger_than_a_real_small_dev_shm_is_refused_not_a_sigbus():
    """A real 1 MiB tmpfs on /dev/shm (in a private mount namespace)."""
    run = subprocess.run(["unshare", "-m", "sh", "-c",
                          f"mount -t tmpfs -o size=1m tmpfs /dev/shm && {sys.executable} -c '{SMALL_SHM}' "
                          "&& ls -A /dev/shm"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])  # -7 / 135: SIGBUS
    lines = run.stdout.splitlines()
    assert lines[0].startswith("full: /dev/shm has no room for 4194320 bytes"), run.stdout  # 4 MiB and its token
    assert lines[1:] == []  # the segment is gone


async def test_a_push_without_room_in_shared_memory_goes_by_grpc_and_is_counted(llama, monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    mesh, stop = await start_mesh(llama[1], disaggregated=True, kv_transport="shm")
    try:
        prompt = common_pb2.TokenIds(ids=list(range(5, 45)))
        with_room, _ = await collect(mesh.router, router_pb2.GenerateRequest(token_ids=prompt, sampling=greedy(6)))
        before = metrics.KV_SHM_FALLBACKS._value.get()
        monkeypatch.setattr(os, "posix_fallocate", no_room)
        salted = router_pb2.GenerateRequest(token_ids=prompt, sampling=greedy(6), cache_salt="again")  # prefilled anew
        without, [fin] = await collect(mesh.router, salted)
        assert token_ids(without) == token_ids(with_room) and fin.finished.usage.completion_tokens == 6
        assert metrics.KV_SHM_FALLBACKS._value.get() == before + 1
        assert own_segments() == []
        await wait_idle(mesh)
        record("kv_push_dev_shm_full", "no room in /dev/shm for a KV push (ENOSPC from posix_fallocate, injected): "
               "the push goes by the gRPC stream", {"sent": 1, "completed": 1, "migrated": 0,
                                                    "failed_as_intended": 0, "lost": 0, "duplicate_tokens": 0})
    finally:
        await stop()


async def test_a_push_the_decode_worker_has_no_turn_for_waits_and_is_sent_again(llama):
    """A decode worker takes a bounded number of KV pushes at once (RESOURCE_EXHAUSTED past
    it): a burst of remote prefills waits its turn instead of failing the request, as a
    served profile's 32 streams at once once did."""
    import asyncio

    mesh, stop = await start_mesh(llama[1], disaggregated=True)
    decode = mesh.workers[1].servicer
    try:
        prompt = common_pb2.TokenIds(ids=list(range(5, 45)))
        alone, _ = await collect(mesh.router, router_pb2.GenerateRequest(token_ids=prompt, sampling=greedy(6)))
        before = metrics.KV_PUSH_RETRIES._value.get()
        decode.num_pushes = decode.max_concurrent_pushes  # as if a burst held every slot

        async def free_the_slots():
            await asyncio.sleep(0.3)
            decode.num_pushes = 0
        freeing = asyncio.ensure_future(free_the_slots())
        salted = router_pb2.GenerateRequest(token_ids=prompt, sampling=greedy(6), cache_salt="again")  # prefilled anew
        waited, [fin] = await collect(mesh.router, salted)
        await freeing
        assert token_ids(waited) == token_ids(alone) and fin.finished.usage.completion_tokens == 6
        assert metrics.KV_PUSH_RETRIES._value.get() >= before + 1
        await wait_idle(mesh)
    finally:
        await stop()
