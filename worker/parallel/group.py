# mypy: disable-error-code="arg-type,list-item"
"""A worker group: the ranks of one tensor-, expert- or pipeline-parallel worker, which
the mesh sees as one.

Rank 0 is the engine: it owns the scheduler, the KV block tables and (in a service)
the gRPC server. It starts the other ranks (``python -m worker.parallel.peer``) on
loopback, and before each step it broadcasts that step's inputs (``StepInputs``, one
int64 tensor) through shared memory on the CPU (a gloo group on CUDA); every rank
then runs the same forward on its shard (a pipeline group: the step's micro-batches
in one message, each rank running its stage of each, ``pipeline.py``). The model's
collectives (all-reduce of row-parallel outputs, all-gather of the vocabulary-parallel
logits, the experts' all-to-all) and the pipeline's hand-overs go through shared
memory on the CPU (``shm_comm.py``: gloo takes milliseconds per call here), NCCL on
CUDA, gloo for what does not fit.
Peers keep no scheduler state: they hold their shard of the weights and of the KV
cache, and what each step needs comes in the step.

Failure is all or nothing. A collective that fails (a rank died) or outlasts
``group_timeout_s`` (a rank hangs) raises ``GroupFailed`` on rank 0, whose worker
then exits so the mesh sees one dead worker; a peer dies with rank 0 (the kernel's
parent-death signal) or when a broadcast from it fails. An idle rank 0 pings its
peers (``ping``) well within the timeout so that an idle group is not taken for a
hung one."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch

from kervan.envs import group_peer_hosts, group_timeout_s
from worker.parallel.kv_shards import encode_write
from worker.parallel.shm_comm import SLOT_BYTES, ShmComm
from worker.parallel.state import ParallelState, set_parallel_state
from worker.parallel.step_inputs import StepInputs, decode_micro_batches, encode_micro_batches

STEP, PING, STOP, MICRO_BATCHES, READ_KV, WRITE_KV = 1, 2, 3, 4, 5, 6
JOIN_TIMEOUT_S = 120.0


class GroupFailed(RuntimeError):
    """A rank of the worker group died or hangs: the group cannot step any more."""


def init_rank(rank: int, config, store_path: str, shm: ShmComm | None = None,
              peers: list[subprocess.Popen] | None = None) -> object:
    """Join the group's default process group (a rendezvous of all ranks); returns the
    gloo group that carries rank 0's messages (the default one is NCCL on CUDA).
    ``shm``: this rank's shared-memory collectives (CPU groups), used where they fit;
    ``peers``: on rank 0, the processes of the other ranks, watched while they join."""
    import torch.distributed as dist
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    timeout = timedelta(seconds=group_timeout_s())
    store = rendezvous(rank, config.world_size, store_path, peers or [])
    dist.init_process_group(backend, store=store, rank=rank, world_size=config.world_size, timeout=timeout)
    set_parallel_state(parallel_state(rank, config), shm)
    return dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD


def join_timeout_s() -> float:
    """How long rank 0 waits for the others to join: a peer imports torch first, which
    takes seconds on a loaded machine, so a short group timeout (for hung collectives)
    must not cut the start short."""
    return max(JOIN_TIMEOUT_S, group_timeout_s())


def rendezvous(rank: int, world: int, store_path: str, peers: list[subprocess.Popen]):
    """The group's key-value store, a file in a directory only this user can enter
    (``store_directory``): a TCP store on a loopback port took no credential, and any local
    user could join it and write the addresses gloo's ranks connect to. Rank 0 waits until
    every other rank has joined, failing at once when one of them exits first."""
    import torch.distributed as dist
    timeout = timedelta(seconds=join_timeout_s())
    store = dist.FileStore(store_path, world)  # type: ignore[attr-defined]  # exported, but not in its stubs
    store.set_timeout(timeout)
    if rank:
        store.add("joined", 1)
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while store.add("joined", 0) < world - 1:
        for i, peer in enumerate(peers, start=1):
            if peer.poll() is not None:
                raise GroupFailed(f"rank {i} exited ({peer.returncode}) before it joined the group")
        if time.monotonic() > deadline:
            raise GroupFailed(f"the group's ranks did not all join within {timeout.total_seconds():.0f} s")
        time.sleep(0.02)
    return store


def parallel_state(rank: int, config) -> ParallelState:
    return ParallelState(rank, config.tensor_parallel_size, config.expert_parallel_size,
                         config.pipeline_parallel_size)


def shm_comm(name: str, rank: int, config, create: bool, alive=None) -> ShmComm:
    """The group's shared-memory segment (CPU groups), as rank ``rank`` maps it."""
    return ShmComm(name, rank, config.world_size, SLOT_BYTES, group_timeout_s(), create=create, alive=alive,
                   pipeline=config.pipeline_parallel_size > 1)


def shm_name() -> str:
    return f"kervan-tp-{os.getpid()}-{secrets.token_hex(6)}"


def store_directory() -> Path:
    """A fresh directory (0700) for a group's store file: the ranks are this user's processes."""
    return Path(tempfile.mkdtemp(prefix="kervan-group-"))


def config_json(config) -> str:
    """A resolved EngineConfig for a peer's command line (the dtype by name)."""
    from worker.platform import dtype_name
    return json.dumps({**asdict(config), "dtype": dtype_name(config.dtype)})


class GroupLeader:
    """Rank 0's side: the peers it started and the channel to them."""

    def __init__(self, peers: list[subprocess.Popen], control: object, shm: ShmComm | None, store_dir: Path):
        self.peers = peers
        self.store_dir = store_dir
        self.control = control
        self.shm = shm
        # int64 values of a message the shared-memory slot carries; a larger one's payload goes over gloo
        self.max_inline = shm.slot_bytes // 8 - 2 if shm is not None else 0
        self.failed: GroupFailed | None = None

    @classmethod
    def start(cls, model_dir: str | Path, config) -> GroupLeader:
        """Start ranks 1..N-1 of a group of ``config.world_size`` and join it as rank 0."""
        world = config.world_size
        store_dir = store_directory()
        store_path = str(store_dir / "store")
        peers: list[subprocess.Popen] = []
        shm = None
        hosts = group_peer_hosts()  # peers on other hosts: gloo over their network, no shared memory
        if hosts is not None and len(hosts) != world - 1:
            raise ValueError(f"a group of {world} ranks needs {world - 1} peer hosts, got {len(hosts)}")
        if not config.device.startswith("cuda") and hosts is None:
            shm = shm_comm(shm_name(), 0, config, create=True, alive=lambda: all(p.poll() is None for p in peers))
        argv = [sys.executable, "-m", "worker.parallel.peer", "--model", str(model_dir), "--world", str(world),
                "--store", store_path, "--config", config_json(config), "--shm", shm.shm.name if shm else ""]
        try:
            peers += [subprocess.Popen([*(hosts[rank - 1] if hosts else []), *argv, "--rank", str(rank)],
                                       stdin=subprocess.DEVNULL) for rank in range(1, world)]
            control = init_rank(0, config, store_path, shm, peers)
        except BaseException:
            for peer in peers:
                peer.kill()
                peer.wait()
            shutil.rmtree(store_dir, ignore_errors=True)
            raise
        finally:
            if shm is not None:
                shm.unlink()  # every rank has mapped it (or the group never formed): no name outlives it
        return cls(peers, control, shm, store_dir)

    def send(self, step: StepInputs) -> None:
        self._broadcast(STEP, step.encode())

    def send_micro_batches(self, steps: list[StepInputs]) -> None:
        self._broadcast(MICRO_BATCHES, encode_micro_batches(steps))

    def read_kv(self, block_ids: list[int]) -> None:
        """Ask the peers for their parts of these blocks' KV (``kv_shards.gather`` follows)."""
        self._broadcast(READ_KV, torch.tensor(block_ids, dtype=torch.int64))

    def write_kv(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Send the peers imported KV (all layers and heads); each keeps its part."""
        self._broadcast(WRITE_KV, encode_write(block_ids, data))

    def ping(self) -> None:
        """Tell idle peers that rank 0 lives (a broadcast they wait in would otherwise time out)."""
        self._broadcast(PING)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the peers and leave the group (this process can then serve one rank alone)."""
        import torch.distributed as dist
        if self.failed is None:
            try:
                self._broadcast(STOP)
            except GroupFailed:
                pass
        for peer in self.peers:
            if self.failed is not None:
                peer.kill()  # a broken group's ranks are not waited for (one may hang)
            try:
                peer.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                peer.kill()
                peer.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        set_parallel_state(ParallelState())
        if self.shm is not None:
            self.shm.close()
        shutil.rmtree(self.store_dir, ignore_errors=True)

    def _broadcast(self, kind: int, payload: torch.Tensor | None = None) -> None:
        import torch.distributed as dist
        if self.failed is not None:
            raise self.failed
        size = 0 if payload is None else payload.numel()
        header = torch.tensor([kind, size], dtype=torch.int64)
        try:
            if self.shm is not None:
                inline = size <= self.max_inline
                self.shm.send(torch.cat([header, payload]) if size and inline else header)
                if not size or inline:
                    return  # else the header alone said: the payload follows over gloo
            else:
                dist.broadcast(header, src=0, group=self.control)
            if payload is not None:
                dist.broadcast(payload, src=0, group=self.control)
        except (RuntimeError, ValueError) as exc:
            raise self.fail(exc) from exc

    def fail(self, exc: BaseException) -> GroupFailed:
        """The group is broken for good: every later call raises this."""
        dead = [f"rank {k + 1} (exit {p.poll()})" for k, p in enumerate(self.peers) if p.poll() is not None]
        self.failed = GroupFailed(f"worker group failed ({', '.join(dead) or 'no rank exited: one hangs'}): {exc}")
        return self.failed


def receive(control: object, shm: ShmComm | None) -> tuple[int, object]:
    """A peer's next message from rank 0: (STEP, a step), (MICRO_BATCHES, a list of
    them), (READ_KV or WRITE_KV, the int64 payload), (PING or STOP, None)."""
    import torch.distributed as dist
    payload = None
    if shm is not None:
        message = shm.receive()
        kind, size = message[:2].tolist()
        if len(message) == size + 2:
            payload = message[2:]
    else:  # a payload too large for the shared-memory slot comes over gloo, as without one
        header = torch.empty(2, dtype=torch.int64)
        dist.broadcast(header, src=0, group=control)
        kind, size = header.tolist()
    if size and payload is None:
        payload = torch.empty(size, dtype=torch.int64)
        dist.broadcast(payload, src=0, group=control)
    if kind == STEP:
        return kind, StepInputs.decode(payload)
    if kind == MICRO_BATCHES:
        return kind, decode_micro_batches(payload)
    return kind, payload if kind in (READ_KV, WRITE_KV) else None


def peer_config(text: str):
    """Rank 0's resolved EngineConfig, from ``config_json``."""
    from worker.config import EngineConfig
    return EngineConfig(**json.loads(text))

