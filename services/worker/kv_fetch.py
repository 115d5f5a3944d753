"""The cluster KV tier over gRPC: one worker sends another the blocks of a prompt's prefix it
holds (``FetchKv``), so the other computes only the rest; and what every KV transfer measures of
the link, which placement prices moving blocks with.

The holder reads the leading blocks it holds on its engine thread (pool, host tier; a disk tail
on the disk tier's thread: ``worker/kv/cluster_tier.py``) and streams them as a push does: a
header, then 1 MiB chunks of raw bytes, nothing pickled. The fetcher reserves the header's bytes
against its own budget before buffering one (``KvStaging``), under a deadline; a fetch that fails
for any reason leaves the prompt to be computed, never fails the request."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator

import grpc
import torch

from kervan.block_hash import BlockHash, hash_blocks
from kervan.sampling import InvalidRequest
from services.common.errors import Overloaded
from services.proto import common_pb2, worker_pb2, worker_pb2_grpc
from services.worker import kv_transfer, metrics
from services.worker.async_engine import AsyncEngine
from services.worker.link_meter import LinkMeter
from worker import FetchedKV

log = logging.getLogger(__name__)

MAX_FETCH_BLOCKS = 1 << 16
def hashes_digest(hashes: list[bytes]) -> bytes:
    return hashlib.sha256(b"".join(hashes)).digest()


async def serve(engine: AsyncEngine, hashes: list[BlockHash]) -> AsyncIterator[worker_pb2.FetchKvResponse]:
    """A ``FetchKv`` answer: the header of the leading blocks held here, then their bytes."""
    if len(hashes) > MAX_FETCH_BLOCKS:
        raise InvalidRequest(f"a fetch asks for at most {MAX_FETCH_BLOCKS} blocks, got {len(hashes)}")
    if any(len(h) != 32 for h in hashes):
        raise InvalidRequest("block_hashes must be 32-byte SHA-256 block hashes")
    read = await engine.call(lambda e: e.read_prefix(hashes))
    data = read.data
    if read.disk is not None:
        got, raw = await asyncio.wrap_future(read.disk)
        if got:
            from_disk = await engine.call(lambda e: e.disk_blocks(raw))
            data = torch.cat([data, from_disk], dim=2) if data.shape[2] else from_disk
    head = worker_pb2.KvHeader(shape=list(data.shape), dtype=kv_transfer.DTYPE_NAMES[data.dtype],
                               num_bytes=data.numel() * data.element_size(), prompt_digest=hashes_digest(hashes))
    metrics.KV_FETCHES.labels("served").inc()
    metrics.KV_TRANSFER_BYTES.labels("served").inc(head.num_bytes)
    async for message in kv_transfer.stream_messages(head, data):
        yield worker_pb2.FetchKvResponse(header=message.header) if message.HasField("header") else \
            worker_pb2.FetchKvResponse(chunk=message.chunk)


async def fetch(stub: worker_pb2_grpc.WorkerServiceStub, source: common_pb2.KvSource, prompt: list[int],
                block_size: int, cache_salt: bytes, staging: kv_transfer.KvStaging, link: LinkMeter,
                timeout_s: float) -> FetchedKV | None:
    """The blocks ``source`` names, fetched from the worker holding them; None (the prompt is
    computed) when the fetch fails or brings none."""
    first, end = source.first_block, source.first_block + source.num_blocks
    wanted = hash_blocks(prompt[:end * block_size], block_size, cache_salt)[first:end]
    if not wanted:
        return None
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            head, data = await kv_transfer.receive(stub.FetchKv(worker_pb2.FetchKvRequest(block_hashes=wanted)),
                                                   staging)
        staging.release(head.num_bytes)  # used at once: the engine copies it into the pool
        if head.prompt_digest != hashes_digest(wanted):
            raise InvalidRequest("the holder answered for other blocks")
    except (grpc.aio.AioRpcError, InvalidRequest, Overloaded, TimeoutError) as err:
        detail = err.code().name if isinstance(err, grpc.aio.AioRpcError) else str(err)
        log.warning("fetching %d blocks from %s failed (%s): computing them", len(wanted), source.address, detail)
        metrics.KV_FETCHES.labels("failed").inc()
        return None
    link.observe(head.num_bytes, time.perf_counter() - start)
    metrics.KV_TRANSFER_BYTES.labels("fetched").inc(head.num_bytes)
    if not data.shape[2]:
        metrics.KV_FETCHES.labels("empty").inc()
        return None
    metrics.KV_FETCHES.labels("fetched").inc()
    return FetchedKV(first, data)
