"""Moving a request's KV from a prefill worker to a decode worker.

One interface, two paths, both on the decode worker's ``PushKv`` stream:
- shared memory (same host): the sender copies the tensor into a fresh
  ``multiprocessing.shared_memory`` segment (its pages reserved first: without room
  the push takes the gRPC stream, counted), after 16 random bytes, and sends only a
  header naming it with those bytes (``shm_token``); the receiver checks them, copies
  the tensor out and unlinks the segment (a segment whose token differs is left alone);
- gRPC streaming (any host): the header, then the raw bytes in 1 MiB chunks.

Only raw tensor bytes plus an explicit shape and a dtype from a short allow-list
cross the wire: nothing is pickled. Copies here use numpy (a plain memcpy): this
code runs on the gRPC thread, and torch work there would start a second OpenMP
team that slows the engine thread's matmuls. The receiver keeps what it got in
``KvStaging`` under a handle it mints, bound to the request and to the prompt's
digest, until ``Decode`` takes it or its lease runs out.

What a sender may make the receiver commit is bounded before it is committed: the
header's size is reserved against the staging budget (or refused) before a byte
is buffered, the lease is at most the receiver's own, and a push past the
receiver's concurrency cap is refused at once.

Segments are named ``kervan-kv-<creator pid>-<random>``: one whose creator has
died (SIGKILLed mid-handoff) is swept when a worker starts."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import hmac
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

from kervan.sampling import InvalidRequest
from services.common.errors import Overloaded
from services.proto import worker_pb2

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
SHM_PREFIX = "kervan-kv-"  # the receiver opens (and unlinks) only segments named so
SHM_TOKEN_BYTES = 16  # a segment starts with its token: the proof that a push names its own segment
SHM_DIR = "/dev/shm"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _as_bytes(data: torch.Tensor) -> torch.Tensor:
    return data.contiguous().view(torch.uint8).reshape(-1)


def prompt_digest(prompt: Sequence[int]) -> bytes:
    return hashlib.sha256(np.asarray(prompt, dtype="<u4").tobytes()).digest()


def header(request_id: str, prompt: Sequence[int], data: torch.Tensor, lease_s: float,
           export: SharedMemoryExport | None = None) -> worker_pb2.KvHeader:
    return worker_pb2.KvHeader(request_id=request_id, shape=list(data.shape),
                               dtype=DTYPE_NAMES[data.dtype], num_bytes=data.numel() * data.element_size(),
                               shm_name=export.name if export else "", shm_token=export.token if export else b"",
                               lease_ms=int(lease_s * 1000), prompt_digest=prompt_digest(prompt))


async def stream_messages(head: worker_pb2.KvHeader, data: torch.Tensor) -> AsyncIterator[worker_pb2.PushKvRequest]:
    """The PushKv messages for the gRPC-stream path: header, then chunks."""
    raw = _as_bytes(data).numpy()
    yield worker_pb2.PushKvRequest(header=head)
    for start in range(0, raw.size, CHUNK_BYTES):
        yield worker_pb2.PushKvRequest(chunk=raw[start:start + CHUNK_BYTES].tobytes())


class SharedMemoryFull(Exception):
    """No room in shared memory for a segment (a small or full ``/dev/shm``)."""


class SharedMemoryExport:
    """A tensor copied into a named segment; the receiver unlinks it after copying out,
    the sender's ``discard`` unlinks it if the push failed.

    The segment's pages are reserved before the copy (``posix_fallocate``): on a tmpfs
    without room (Docker's 64 MiB ``/dev/shm``) a plain segment is created all the same and
    the copy into it dies of SIGBUS; here it raises ``SharedMemoryFull`` instead, and
    leaves nothing behind."""

    def __init__(self, data: torch.Tensor):
        raw = _as_bytes(data)
        self.token = secrets.token_bytes(SHM_TOKEN_BYTES)
        size = SHM_TOKEN_BYTES + raw.numel()
        self.shm = shared_memory.SharedMemory(name=f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex}", create=True,
                                              size=size)
        # the receiver owns the segment's end; don't let this process's tracker unlink it
        resource_tracker.unregister(self.shm._name, "shared_memory")  # type: ignore[attr-defined]  # the tracker's key
        self.name = self.shm.name
        try:
            _reserve(self.shm._fd, size)  # type: ignore[attr-defined]  # the segment's descriptor, not exposed
        except SharedMemoryFull:
            self.discard()
            raise
        buf = _buffer(self.shm)
        buf[:SHM_TOKEN_BYTES] = self.token
        np.frombuffer(buf, dtype=np.uint8, count=raw.numel(), offset=SHM_TOKEN_BYTES)[:] = raw.numpy()

    def close(self) -> None:
        self.shm.close()

    def discard(self) -> None:
        self.close()
        try:
            shared_memory.SharedMemory(name=self.name).unlink()
        except FileNotFoundError:
            pass


def _reserve(fd: int, size: int) -> None:
    """Back ``size`` bytes of a segment with pages now, or raise ``SharedMemoryFull``."""
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise SharedMemoryFull(f"{SHM_DIR} has no room for {size} bytes") from None
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    except AttributeError:  # no posix_fallocate (macOS)
        pass
    try:  # a file system that cannot reserve: at least see that the room is there
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return
    if stat.f_bavail * stat.f_frsize < size:
        raise SharedMemoryFull(f"{SHM_DIR} has {stat.f_bavail * stat.f_frsize} bytes free, not {size}")


def sweep_stale_segments(directory: str = SHM_DIR) -> int:
    """Unlinks the KV segments whose creating process is gone; returns how many."""
    swept = 0
    try:
        names = os.listdir(directory)
    except OSError:  # no /dev/shm (not Linux): nothing to sweep
        return 0
    for name in names:
        pid = name.removeprefix(SHM_PREFIX).split("-", 1)[0]
        if not name.startswith(SHM_PREFIX) or not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            swept += 1
        except OSError:
            pass
    if swept:
        log.warning("removed %d KV segments left in %s by processes that died mid-handoff", swept, directory)
    return swept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to judge
        return True
    return True


def read_shared_memory(head: worker_pb2.KvHeader) -> torch.Tensor:
    if not head.shm_name.startswith(SHM_PREFIX) or "/" in head.shm_name:
        raise InvalidRequest(f"shm_name must be a Kervan KV segment ({SHM_PREFIX}...), got {head.shm_name!r}")
    try:
        shm = shared_memory.SharedMemory(name=head.shm_name)
    except FileNotFoundError:
        raise InvalidRequest(f"shared memory segment {head.shm_name!r} does not exist") from None
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # its end is this function's, or its creator's
    try:
        if shm.size < SHM_TOKEN_BYTES or not hmac.compare_digest(bytes(_buffer(shm)[:SHM_TOKEN_BYTES]), head.shm_token):
            raise InvalidRequest(f"shared memory segment {head.shm_name!r} is not this push's (its token differs)")
    except BaseException:
        shm.close()  # left to its creator: another hand-off's segment, named by a caller that cannot read it
        raise
    try:
        if shm.size < SHM_TOKEN_BYTES + head.num_bytes:
            raise InvalidRequest(f"shared memory {head.shm_name} holds {shm.size - SHM_TOKEN_BYTES} bytes, header "
                                 f"says {head.num_bytes}")
        raw = torch.from_numpy(np.frombuffer(_buffer(shm), dtype=np.uint8, count=head.num_bytes,
                                             offset=SHM_TOKEN_BYTES).copy())
    finally:
        shm.close()
        shm.unlink()
    return raw


def tensor_from(head: worker_pb2.KvHeader, raw: torch.Tensor) -> torch.Tensor:
    dtype = DTYPES.get(head.dtype)
    if dtype is None:
        raise InvalidRequest(f"KV dtype {head.dtype!r} is not one of {sorted(DTYPES)}")
    shape = tuple(head.shape)
    expected = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    if raw.numel() != head.num_bytes or expected != head.num_bytes:
        raise InvalidRequest(f"KV of shape {shape} {head.dtype} needs {expected} bytes, got {raw.numel()}")
    return raw.view(dtype).reshape(shape)


@dataclass
class _Staged:
    request_id: str
    prompt_digest: bytes
    data: torch.Tensor
    expires_at: float


class KvStaging:
    """KV received for requests whose Decode has not arrived yet, each under a lease.
    ``reserve`` commits a push's bytes against the budget when its header arrives;
    ``put`` turns the reservation into a staged entry, ``release`` gives it back. An
    entry goes when its lease ends, whether or not anything else happens on the worker
    (a timer on the event loop that staged it)."""

    def __init__(self, max_bytes: int = 2 << 30, max_lease_s: float = 30.0):
        self.max_bytes = max_bytes
        self.max_lease_s = max_lease_s
        self.reserved = 0
        self._items: dict[str, _Staged] = {}

    @property
    def num_bytes(self) -> int:
        return sum(i.data.numel() * i.data.element_size() for i in self._items.values())

    def reserve(self, num_bytes: int) -> None:
        self.expire()
        if num_bytes > self.max_bytes:
            raise InvalidRequest(f"KV of {num_bytes} bytes exceeds this worker's staging ({self.max_bytes})")
        if self.num_bytes + self.reserved + num_bytes > self.max_bytes:
            raise Overloaded("KV staging is full; retry later")
        self.reserved += num_bytes

    def release(self, num_bytes: int) -> None:
        self.reserved -= num_bytes

    def put(self, head: worker_pb2.KvHeader, data: torch.Tensor) -> str:
        """Stages a reserved push; returns the handle minted for it."""
        self.release(head.num_bytes)
        lease_s = min(head.lease_ms / 1000 or self.max_lease_s, self.max_lease_s)
        handle = secrets.token_hex(16)
        self._items[handle] = _Staged(head.request_id, head.prompt_digest, data, time.monotonic() + lease_s)
        try:
            asyncio.get_running_loop().call_later(lease_s + 0.01, self.expire)
        except RuntimeError:  # no event loop (a direct caller): the next reserve or take expires it
            pass
        return handle

    def take(self, handle: str, request_id: str, prompt: Sequence[int]) -> torch.Tensor:
        self.expire()
        item = self._items.get(handle)
        if item is None or item.request_id != request_id:
            raise InvalidRequest(f"kv_handle {handle!r} is unknown or its lease expired")
        if item.prompt_digest != prompt_digest(prompt):
            raise InvalidRequest(f"kv_handle {handle!r} holds KV pushed for another prompt")
        del self._items[handle]
        return item.data

    def drop_request(self, request_id: str) -> None:
        for handle in [h for h, i in self._items.items() if i.request_id == request_id]:
            del self._items[handle]

    def expire(self) -> None:
        now = time.monotonic()
        for handle in [h for h, i in self._items.items() if i.expires_at < now]:
            del self._items[handle]


async def receive(messages: AsyncIterator[worker_pb2.PushKvRequest], staging: KvStaging
                  ) -> tuple[worker_pb2.KvHeader, torch.Tensor]:
    """Read one PushKv stream into (header, tensor), its bytes reserved in ``staging``
    from the header on (released if the stream fails; the caller ``put``s it)."""
    head = None
    buf = bytearray()
    size = 0
    try:
        async for msg in messages:
            if msg.WhichOneof("part") == "header":
                if head is not None:
                    raise InvalidRequest("PushKv carries more than one header")
                if len(msg.header.prompt_digest) != 32:
                    raise InvalidRequest("PushKv header needs the prompt's SHA-256 digest (32 bytes)")
                staging.reserve(msg.header.num_bytes)
                head = msg.header
                if not head.shm_name:
                    buf = bytearray(head.num_bytes)
            else:
                if head is None or head.shm_name:
                    raise InvalidRequest("PushKv chunks must follow a header without shm_name")
                if size + len(msg.chunk) > head.num_bytes:
                    raise InvalidRequest(f"PushKv sent more than the {head.num_bytes} bytes its header announced")
                buf[size:size + len(msg.chunk)] = msg.chunk
                size += len(msg.chunk)
        if head is None:
            raise InvalidRequest("PushKv carried no header")
        if head.shm_name:
            raw = read_shared_memory(head)
        elif size != head.num_bytes:
            raise InvalidRequest(f"PushKv ended after {size} of {head.num_bytes} bytes")
        else:
            raw = torch.frombuffer(buf, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        return head, tensor_from(head, raw)
    except BaseException:
        if head is not None:
            staging.release(head.num_bytes)
        raise


def _buffer(shm: shared_memory.SharedMemory) -> memoryview:
    """An open segment's bytes (``buf`` is None only once it is closed)."""
    if shm.buf is None:
        raise ValueError(f"shared memory segment {shm.name} is closed")
    return shm.buf
