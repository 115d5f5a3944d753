"""A worker group tells a slow rank from a hung one: two real processes share a group's
segment (``ShmComm``, a 1 s group timeout) while a third spins beside them on the two cores.
A rank that computes for longer than the timeout — in Python holding the GIL, in PyTorch,
or blocked in a sleep — is waited for; one that is stopped (SIGSTOP), or waits itself
while the other waits too, fails the collective within the timeout's bound."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager

import pytest
import torch

from worker.parallel.shm_comm import ShmComm

TIMEOUT_S = 1.0
SLOW_S = 2.5  # over twice the timeout

PEER = """
import sys, time
import torch
from worker.parallel.shm_comm import ShmComm
name, works, seconds, timeout = sys.argv[1], sys.argv[2].split(","), float(sys.argv[3]), float(sys.argv[4])
comm = ShmComm(name, 1, 2, 4096, timeout, create=False)
print("ready", flush=True)
sys.stdin.readline()  # rank 0 is in the collective now
for work in works:
    end = time.monotonic() + seconds
    if work == "python":  # holds the GIL but for the interpreter's switches
        while time.monotonic() < end:
            sum(i * i for i in range(1000))
    elif work == "torch":
        a = torch.randn(256, 256)
        while time.monotonic() < end:
            a = torch.tanh(a @ a)
    elif work == "sleep":
        time.sleep(seconds)
    elif work == "wait":  # waits for a message rank 0 never sends: both ranks wait
        try:
            comm.receive()
        except RuntimeError as exc:
            print(exc, flush=True)
            sys.exit(3)
    out = comm.all_reduce(torch.full((4,), 2.0))
    print(out.tolist(), flush=True)
"""


@contextmanager
def busy_cores(n: int):
    """``n`` processes that spin, so the ranks share the cores with other work."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@contextmanager
def group(works: str, seconds: float = SLOW_S):
    """Rank 0 here, rank 1 a process doing each of ``works`` for ``seconds`` before it joins
    a collective; yields (rank 0's comm, rank 1's process) once rank 1 is in the segment."""
    name = f"kervan-test-{uuid.uuid4().hex[:12]}"
    comm = ShmComm(name, 0, 2, 4096, TIMEOUT_S, create=True)
    peer = subprocess.Popen([sys.executable, "-c", PEER, name, works, str(seconds), str(TIMEOUT_S)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout.readline() == "ready\n"
        comm.unlink()
        peer.stdin.write("go\n")
        peer.stdin.flush()
        yield comm, peer
    finally:
        peer.kill()
        peer.wait()
        comm.close()


def test_a_rank_slower_than_the_timeout_is_waited_for_on_busy_cores():
    """Rank 1 computes in Python, then in PyTorch, then sleeps, each for over twice the
    timeout before it joins the next collective."""
    with busy_cores(1), group("python,torch,sleep") as (comm, peer):
        for work in ("python", "torch", "sleep"):
            start = time.monotonic()
            out = comm.all_reduce(torch.full((4,), 1.0))
            waited = time.monotonic() - start
            assert out.tolist() == [3.0] * 4, work
            assert peer.stdout.readline() == "[3.0, 3.0, 3.0, 3.0]\n", work
            assert waited > SLOW_S - 0.5, work  # it really waited past the timeout


def test_a_stopped_rank_fails_the_collective_within_the_timeout():
    with group("sleep", seconds=60) as (comm, peer):
        time.sleep(0.5)
        os.kill(peer.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1: last heartbeat .* not waiting\): a rank hangs"):
            comm.all_reduce(torch.ones(4))
        assert TIMEOUT_S - 0.1 < time.monotonic() - start < 3 * TIMEOUT_S + 1


def test_ranks_that_wait_for_each_other_fail_within_the_timeout():
    """Rank 1 waits for a message, rank 0 in a collective: both beat, neither works. Whichever
    gives up first stops waiting (rank 0 then kills its peers, as ``GroupLeader`` does)."""
    with group("wait") as (comm, peer):
        start = time.monotonic()
        try:
            comm.all_reduce(torch.ones(4))
        except RuntimeError as exc:
            assert "a rank hangs" in str(exc)
        else:
            raise AssertionError("the collective returned though rank 1 never joined it")
        assert time.monotonic() - start < 3 * TIMEOUT_S + 1
        if peer.poll() is not None:  # rank 1 gave up first
            assert peer.returncode == 3 and "a rank hangs" in peer.stdout.read()


def test_a_closed_group_stops_its_heartbeat():
    name = f"kervan-test-{uuid.uuid4().hex[:12]}"
    comm = ShmComm(name, 0, 1, 4096, TIMEOUT_S, create=True)
    comm.unlink()
    thread = comm._heartbeat._thread
    assert thread.is_alive()
    comm.close()
    assert not thread.is_alive()
