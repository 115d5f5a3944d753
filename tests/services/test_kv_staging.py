"""What a KV push can make a decode worker commit, and the segments it can leave behind."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from services.common.errors import Overloaded
from services.proto import worker_pb2
from services.worker import kv_transfer
from worker import InvalidRequest

PROMPT = [5, 6, 7]


def header(num_bytes: int, lease_ms: int = 1000, request_id: str = "r") -> worker_pb2.KvHeader:
    return worker_pb2.KvHeader(request_id=request_id, num_bytes=num_bytes, dtype="float32", shape=[num_bytes // 4],
                               lease_ms=lease_ms, prompt_digest=kv_transfer.prompt_digest(PROMPT))


async def messages(head, *chunks):
    yield worker_pb2.PushKvRequest(header=head)
    for chunk in chunks:
        yield worker_pb2.PushKvRequest(chunk=chunk)


async def test_the_budget_is_reserved_at_the_header_and_given_back_when_a_push_fails():
    staging = kv_transfer.KvStaging(max_bytes=64, max_lease_s=5.0)
    staging.reserve(48)  # a push in flight
    with pytest.raises(Overloaded):  # refused at the header: no buffer allocated for it
        await kv_transfer.receive(messages(header(32), b"\0" * 32), staging)
    staging.release(48)
    with pytest.raises(InvalidRequest, match="more than"):  # more bytes than announced
        await kv_transfer.receive(messages(header(8), b"\0" * 12), staging)
    with pytest.raises(InvalidRequest, match="ended after"):  # the sender went away mid-stream
        await kv_transfer.receive(messages(header(8), b"\0" * 4), staging)
    assert staging.reserved == 0  # every failed push gave its reservation back
    head, data = await kv_transfer.receive(messages(header(64), b"\0" * 64), staging)
    assert staging.reserved == 64
    handle = staging.put(head, data)
    assert staging.reserved == 0 and staging.num_bytes == 64 and len(handle) == 32


async def test_the_receiver_clamps_the_lease_and_binds_the_kv_to_its_prompt():
    staging = kv_transfer.KvStaging(max_bytes=64, max_lease_s=0.2)
    head, data = await kv_transfer.receive(messages(header(8, lease_ms=2**32 - 1), b"\0" * 8), staging)
    handle = staging.put(head, data)  # asked for 49 days
    with pytest.raises(InvalidRequest, match="another prompt"):
        staging.take(handle, "r", PROMPT + [8])
    with pytest.raises(InvalidRequest, match="unknown"):
        staging.take(handle, "other-request", PROMPT)
    assert staging.take(handle, "r", PROMPT).numel() == 2
    head, data = await kv_transfer.receive(messages(header(8, lease_ms=2**32 - 1), b"\0" * 8), staging)
    handle = staging.put(head, data)
    time.sleep(0.25)  # the receiver's lease, not the sender's
    with pytest.raises(InvalidRequest, match="expired"):
        staging.take(handle, "r", PROMPT)


async def test_staged_kv_goes_when_its_lease_ends_on_a_worker_that_does_nothing_else():
    """No other push or decode comes to expire it: the lease's own timer does."""
    staging = kv_transfer.KvStaging(max_bytes=64, max_lease_s=0.2)
    head, data = await kv_transfer.receive(messages(header(8), b"\0" * 8), staging)
    staging.put(head, data)
    assert staging.num_bytes == 8
    await asyncio.sleep(0.4)
    assert staging.num_bytes == 0


def test_segments_of_dead_processes_are_swept_and_the_living_ones_kept(tmp_path):
    import subprocess
    import sys
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    names = [f"{kv_transfer.SHM_PREFIX}{dead}-abc", f"{kv_transfer.SHM_PREFIX}{os.getpid()}-def",
             f"{kv_transfer.SHM_PREFIX}legacy", "other-segment"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert kv_transfer.sweep_stale_segments(str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])


def test_a_push_that_names_another_hand_offs_segment_neither_reads_nor_unlinks_it():
    """A segment's name shows in /dev/shm to every local user; its first bytes, a token, only
    to its creator. A push naming another hand-off's segment without that token (a worker-role
    caller that listed /dev/shm) is refused and the segment is left for its own push."""
    import torch
    data = torch.arange(8, dtype=torch.float32)
    theirs = kv_transfer.SharedMemoryExport(data)
    try:
        head = kv_transfer.header("r", PROMPT, data, 1.0, theirs)
        for token in (b"", b"\0" * kv_transfer.SHM_TOKEN_BYTES, head.shm_token[::-1]):
            forged = worker_pb2.KvHeader()
            forged.CopyFrom(head)
            forged.shm_token = token
            with pytest.raises(InvalidRequest, match="is not this push's"):
                kv_transfer.read_shared_memory(forged)
            assert os.path.exists(f"{kv_transfer.SHM_DIR}/{theirs.name}")  # still there, untouched
        raw = kv_transfer.read_shared_memory(head)  # the push that made it
        assert torch.equal(kv_transfer.tensor_from(head, raw), data)
        assert not os.path.exists(f"{kv_transfer.SHM_DIR}/{theirs.name}")  # read once, then gone
    finally:
        theirs.discard()
