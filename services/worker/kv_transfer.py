"""Moving a request's KV from a prefill worker to a decode worker.

One interface, two paths, both on the decode worker's ``PushKv`` stream:
- shared memory (same host): the sender copies the tensor into a fresh
  ``multiprocessing.shared_memory`` segment and sends only a header naming it;
  the receiver copies it out and unlinks the segment;
- gRPC streaming (any host): the header, then the raw bytes in 1 MiB chunks.

Only raw tensor bytes plus an explicit shape and a dtype from a short allow-list
cross the wire: nothing is pickled. Copies here use numpy (a plain memcpy): this
code runs on the gRPC thread, and torch work there would start a second OpenMP
team that slows the engine thread's matmuls. The receiver keeps what it got in
``KvStaging`` under a handle until ``Decode`` takes it or its lease runs out."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

from kervan.sampling import InvalidRequest
from services.proto import worker_pb2

CHUNK_BYTES = 1 << 20
SHM_PREFIX = "kervan-kv-"  # the receiver opens (and unlinks) only segments named so
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _as_bytes(data: torch.Tensor) -> torch.Tensor:
    return data.contiguous().view(torch.uint8).reshape(-1)


def header(handle: str, request_id: str, data: torch.Tensor, lease_s: float, shm_name: str = "") -> worker_pb2.KvHeader:
    return worker_pb2.KvHeader(handle=handle, request_id=request_id, shape=list(data.shape),
                               dtype=DTYPE_NAMES[data.dtype], num_bytes=data.numel() * data.element_size(),
                               shm_name=shm_name, lease_ms=int(lease_s * 1000))


def stream_messages(request_id: str, data: torch.Tensor, lease_s: float
                    ) -> tuple[str, AsyncIterator[worker_pb2.PushKvRequest]]:
    """The PushKv messages for the gRPC-stream path: header, then chunks."""
    handle = uuid.uuid4().hex
    raw = _as_bytes(data).numpy()

    async def messages():
        yield worker_pb2.PushKvRequest(header=header(handle, request_id, data, lease_s))
        for start in range(0, raw.size, CHUNK_BYTES):
            yield worker_pb2.PushKvRequest(chunk=raw[start:start + CHUNK_BYTES].tobytes())
    return handle, messages()


class SharedMemoryExport:
    """A tensor copied into a named segment; the receiver unlinks it after copying out,
    the sender's ``discard`` unlinks it if the push failed."""

    def __init__(self, data: torch.Tensor):
        raw = _as_bytes(data)
        self.shm = shared_memory.SharedMemory(name=SHM_PREFIX + uuid.uuid4().hex, create=True,
                                              size=max(1, raw.numel()))
        # the receiver owns the segment's end; don't let this process's tracker unlink it
        resource_tracker.unregister(self.shm._name, "shared_memory")
        np.frombuffer(self.shm.buf, dtype=np.uint8, count=raw.numel())[:] = raw.numpy()
        self.name = self.shm.name

    def close(self) -> None:
        self.shm.close()

    def discard(self) -> None:
        self.close()
        try:
            shared_memory.SharedMemory(name=self.name).unlink()
        except FileNotFoundError:
            pass


def read_shared_memory(head: worker_pb2.KvHeader) -> torch.Tensor:
    if not head.shm_name.startswith(SHM_PREFIX) or "/" in head.shm_name:
        raise InvalidRequest(f"shm_name must be a Kervan KV segment ({SHM_PREFIX}...), got {head.shm_name!r}")
    try:
        shm = shared_memory.SharedMemory(name=head.shm_name)
    except FileNotFoundError:
        raise InvalidRequest(f"shared memory segment {head.shm_name!r} does not exist") from None
    try:
        if shm.size < head.num_bytes:
            raise InvalidRequest(f"shared memory {head.shm_name} holds {shm.size} bytes, header says {head.num_bytes}")
        raw = torch.from_numpy(np.frombuffer(shm.buf, dtype=np.uint8, count=head.num_bytes).copy())
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
    data: torch.Tensor
    expires_at: float


class KvStaging:
    """KV received for requests whose Decode has not arrived yet, each under a lease."""

    def __init__(self, max_bytes: int = 2 << 30):
        self.max_bytes = max_bytes
        self._items: dict[str, _Staged] = {}

    @property
    def num_bytes(self) -> int:
        return sum(i.data.numel() * i.data.element_size() for i in self._items.values())

    def put(self, head: worker_pb2.KvHeader, data: torch.Tensor) -> None:
        self.expire()
        if self.num_bytes + head.num_bytes > self.max_bytes:
            from services.common.errors import Overloaded
            raise Overloaded("KV staging is full; retry later")
        self._items[head.handle] = _Staged(head.request_id, data, time.monotonic() + head.lease_ms / 1000)

    def take(self, handle: str, request_id: str) -> torch.Tensor:
        self.expire()
        item = self._items.pop(handle, None)
        if item is None or item.request_id != request_id:
            raise InvalidRequest(f"kv_handle {handle!r} is unknown or its lease expired")
        return item.data

    def drop_request(self, request_id: str) -> None:
        for handle in [h for h, i in self._items.items() if i.request_id == request_id]:
            del self._items[handle]

    def expire(self) -> None:
        now = time.monotonic()
        for handle in [h for h, i in self._items.items() if i.expires_at < now]:
            del self._items[handle]


async def receive(messages: AsyncIterator[worker_pb2.PushKvRequest], max_bytes: int
                  ) -> tuple[worker_pb2.KvHeader, torch.Tensor]:
    """Read one PushKv stream into (header, tensor)."""
    head = None
    buf = bytearray()
    size = 0
    async for msg in messages:
        if msg.WhichOneof("part") == "header":
            if head is not None:
                raise InvalidRequest("PushKv carries more than one header")
            head = msg.header
            if head.num_bytes > max_bytes:
                raise InvalidRequest(f"KV of {head.num_bytes} bytes exceeds this worker's staging ({max_bytes})")
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
