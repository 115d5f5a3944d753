"""WorkerService: protobuf in, engine call, protobuf out.

Roles: ``both`` serves everything; ``prefill`` serves Prefill (computing the
prompt and first token, then pushing the prompt's KV to a decode worker under a
lease: its blocks stay pinned until the push is acknowledged or the lease runs
out); ``decode`` serves PushKv and Decode, and Execute for prompts the scheduler
judged too short to prefill remotely. Every role serves FetchKv (the blocks it holds, to the
worker computing a prompt that starts with them: the cluster KV tier, ``kv_fetch.py``) and
fetches the blocks a request's ``kv_source`` names before computing the rest."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from kervan.sampling import FORKED_SAMPLES
from kervan.worker_info import WorkerRole
from services.common.convert import finish_to_proto, load_to_proto, sampling_from_proto
from services.common.errors import Aborted, FailedPrecondition, Overloaded, Unavailable, retry_after_s
from services.proto import worker_pb2, worker_pb2_grpc
from services.worker import kv_fetch, kv_transfer, metrics
from services.worker.async_engine import AsyncEngine
from services.worker.decode_peers import DecodePeers
from worker import ImportedKV, InvalidRequest, RequestOutput

log = logging.getLogger(__name__)

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]", socket.gethostname()}
# which mesh roles may call what (services/common/auth.py): KV comes only from workers
CALLERS = {"PushKv": ("worker",), "FetchKv": ("worker",), "GetLoad": ("router", "scheduler", "admin"),
           "*": ("router", "admin")}


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, engine: AsyncEngine, role: WorkerRole = WorkerRole.BOTH, kv_transport: str = "auto",
                 lease_s: float = 30.0, peers: DecodePeers | None = None, max_concurrent_pushes: int = 16,
                 staging_bytes: int = 2 << 30):
        self.engine = engine
        self.role = WorkerRole(role)  # a name ("decode") or the role
        self.kv_transport = kv_transport
        self.lease_s = lease_s  # the longest a push may take, and its KV wait for Decode
        self.staging = kv_transfer.KvStaging(staging_bytes, max_lease_s=lease_s)
        self.fetch_staging = kv_transfer.KvStaging(staging_bytes, max_lease_s=lease_s)  # fetches in flight
        self.peers = peers or DecodePeers()
        self.max_concurrent_pushes = max_concurrent_pushes
        self.num_pushes = 0

    def _require(self, allowed: bool, needs: str) -> None:
        if not allowed:
            raise FailedPrecondition(f"this worker's role is {self.role}; the call needs a {needs} worker")

    async def Execute(self, request: worker_pb2.ExecuteRequest, context: grpc.aio.ServicerContext):
        self._require(self.role.can_decode, "decode or both")  # a decode worker prefills short prompts itself
        params = sampling_from_proto(request.sampling)
        prompt = list(request.prompt.ids)
        fetched = await self._fetch(request.kv_source, prompt, request.cache_salt)
        async for update in _updates(self.engine.generate(request.request_id, prompt, params, fetched=fetched,
                                                          cache_salt=request.cache_salt.encode())):
            yield worker_pb2.ExecuteResponse(update=update)

    async def Prefill(self, request: worker_pb2.PrefillRequest, context) -> worker_pb2.PrefillResponse:
        self._require(self.role.can_prefill, "prefill or both")
        params = sampling_from_proto(request.sampling)
        rid, prompt = request.request_id, list(request.prompt.ids)
        if params.n != 1:
            raise InvalidRequest(f"{FORKED_SAMPLES}; it is not prefilled for another")
        out = None
        fetched = await self._fetch(request.kv_source, prompt, request.cache_salt)
        async for update in self.engine.generate(rid, prompt, dataclasses.replace(params, max_tokens=1), hold_kv=True,
                                                 fetched=fetched, cache_salt=request.cache_salt.encode()):
            out = update  # the last one: the prompt's first token
        assert out is not None  # generate yields at least once, or raises
        first = out.outputs[0]
        metrics.count_admission(len(prompt), out.num_cached_tokens, out.queue_time_s)
        _first_output_event(out)
        response = worker_pb2.PrefillResponse(first_token=first.token_ids[0],
                                              first_logprob=first.logprobs[0] if first.logprobs else 0.0,
                                              cached_prompt_tokens=out.num_cached_tokens)
        try:
            if first.finish_reason == "stop" or params.max_tokens == 1:
                response.finish_reason = finish_to_proto(first.finish_reason)
                return response
            data = await self.engine.call(lambda e: e.export_kv(rid))
            response.kv_handle, response.kv_bytes = await self._push(request, data)
            return response
        finally:
            # the lease ends here either way; the answer need not wait for the next step
            self.engine.post(lambda e: e.release_kv(rid))

    async def _push(self, request: worker_pb2.PrefillRequest, data) -> tuple[str, int]:
        stub = await self.peers.stub(request.decode_address)
        prompt = request.prompt.ids
        export = None
        if self._use_shared_memory(request):
            try:
                export = kv_transfer.SharedMemoryExport(data)
            except kv_transfer.SharedMemoryFull as full:
                metrics.KV_SHM_FALLBACKS.inc()
                log.warning("KV push by the gRPC stream: %s", full)
        def messages():  # once per attempt: a refused push is sent again whole
            if export is not None:
                return _one(worker_pb2.PushKvRequest(header=kv_transfer.header(
                    request.request_id, prompt, data, self.lease_s, export)))
            return kv_transfer.stream_messages(kv_transfer.header(request.request_id, prompt, data, self.lease_s),
                                               data)
        start = time.perf_counter()
        pushed = False
        try:
            while True:
                try:
                    receipt = await stub.PushKv(messages(), timeout=self.lease_s)
                    break
                except grpc.aio.AioRpcError as err:
                    # the decode worker takes a bounded number of pushes at once: a burst of prompts
                    # waits its turn (the KV is held here meanwhile), up to half a lease
                    wait = retry_after_s(err) if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
                    if wait is None or time.perf_counter() - start + wait > self.lease_s / 2:
                        raise Aborted(f"KV push to the decode worker failed: {err.code().name} {err.details()}") \
                            from None
                    metrics.KV_PUSH_RETRIES.inc()
                    await asyncio.sleep(wait)
            pushed = True
            metrics.KV_PUSHES.labels("shared_memory" if export is not None else "stream").inc()
            if export is None:  # what the link carried (shared memory measures no link)
                self.engine.link.observe(receipt.num_bytes, time.perf_counter() - start)
            metrics.KV_TRANSFER_TIME.observe(time.perf_counter() - start)
            metrics.KV_TRANSFER_BYTES.labels("pushed").inc(receipt.num_bytes)
        finally:
            if export is not None and pushed:
                export.close()
            elif export is not None:  # a failed or cancelled push leaves no segment behind
                export.discard()
        return receipt.handle, receipt.num_bytes

    def _use_shared_memory(self, request: worker_pb2.PrefillRequest) -> bool:
        if request.transport == worker_pb2.KV_TRANSPORT_SHARED_MEMORY:
            return True
        if request.transport == worker_pb2.KV_TRANSPORT_GRPC_STREAM or self.kv_transport == "grpc":
            return False
        return self.kv_transport == "shm" or request.decode_address.rsplit(":", 1)[0] in LOCAL_HOSTS

    async def _fetch(self, source, prompt: list[int], cache_salt: str):
        """The blocks ``source`` names, from the worker holding them (None: none named, or the
        fetch failed and the prompt is computed)."""
        if not source.address or not source.num_blocks:
            return None
        try:
            stub = await self.peers.stub(source.address, any_role=True)
        except (Aborted, Unavailable) as err:
            log.warning("not fetching KV from %s: %s", source.address, err)
            return None
        return await kv_fetch.fetch(stub, source, prompt, self.engine.engine.config.block_size, cache_salt.encode(),
                                    self.fetch_staging, self.engine.link, timeout_s=self.lease_s / 2)

    async def FetchKv(self, request: worker_pb2.FetchKvRequest, context):
        async for message in kv_fetch.serve(self.engine, list(request.block_hashes)):
            yield message

    async def PushKv(self, request_iterator, context) -> worker_pb2.PushKvResponse:
        self._require(self.role.can_decode, "decode or both")
        if self.num_pushes >= self.max_concurrent_pushes:
            raise Overloaded(f"{self.num_pushes} KV pushes in progress, this worker's limit; retry later")
        self.num_pushes += 1
        try:  # a sender that stalls mid-stream cannot hold its reservation past the lease
            head, data = await asyncio.wait_for(kv_transfer.receive(request_iterator, self.staging), self.lease_s)
        except asyncio.TimeoutError:
            raise Unavailable(f"KV push did not finish within {self.lease_s:.0f}s") from None
        finally:
            self.num_pushes -= 1
        handle = self.staging.put(head, data)
        metrics.KV_TRANSFER_BYTES.labels("received").inc(head.num_bytes)
        return worker_pb2.PushKvResponse(handle=handle, num_bytes=head.num_bytes)

    async def Decode(self, request: worker_pb2.DecodeRequest, context):
        self._require(self.role.can_decode, "decode or both")
        params = sampling_from_proto(request.sampling)
        data = self.staging.take(request.kv_handle, request.request_id, request.prompt.ids)
        imported = ImportedKV(request.first_token, request.first_logprob, data)
        stream = self.engine.generate(request.request_id, list(request.prompt.ids), params, imported=imported,
                                      cache_salt=request.cache_salt.encode())
        async for update in _updates(stream):
            yield worker_pb2.DecodeResponse(update=update)

    async def Abort(self, request: worker_pb2.AbortRequest, context) -> worker_pb2.AbortResponse:
        self.staging.drop_request(request.request_id)
        return worker_pb2.AbortResponse(aborted=self.engine.abort(request.request_id))

    async def GetLoad(self, request: worker_pb2.GetLoadRequest, context) -> worker_pb2.GetLoadResponse:
        return worker_pb2.GetLoadResponse(load=load_to_proto(self.engine.load()))

    async def close(self) -> None:
        await self.peers.close()


def _first_output_event(out: RequestOutput) -> None:
    """On the call's span, the engine's side of the request up to its first output: an
    event per prompt chunk computed (at the step's start, with its duration), then the
    first token (with the queue time and the cached prompt tokens)."""
    span = trace.get_current_span()
    for start, tokens, began, ended in out.prefill_chunks:
        span.add_event("kervan.prefill_chunk", {"kervan.chunk.start": start, "kervan.chunk.tokens": tokens,
                                                "kervan.chunk.step_ms": (ended - began) / 1e6}, timestamp=began)
    span.add_event("kervan.first_token", {
        "kervan.queue_time_s": out.queue_time_s or 0.0, "kervan.cached_prompt_tokens": out.num_cached_tokens,
        "gen_ai.usage.input_tokens": len(out.prompt_token_ids)})


async def _updates(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[worker_pb2.TokenUpdate]:
    """Engine outputs -> one TokenUpdate per sample that progressed; each sample's end once."""
    done: set[int] = set()
    first = True
    counted = False
    async for out in outputs:
        if not counted:  # the prompt's prefix-cache lookup and queue time, once
            metrics.count_admission(len(out.prompt_token_ids), out.num_cached_tokens, out.queue_time_s)
            _first_output_event(out)
            counted = True
        for c in out.outputs:
            if c.index in done or not (c.new_token_ids or c.finish_reason):
                continue
            new = len(c.new_token_ids)
            yield worker_pb2.TokenUpdate(
                sample_index=c.index, index=len(c.token_ids) - new, token_ids=c.new_token_ids,
                logprobs=c.logprobs[len(c.logprobs) - new:] if c.logprobs else [],
                finish_reason=finish_to_proto(c.finish_reason),
                cached_prompt_tokens=out.num_cached_tokens if first else 0)
            first = False
            if c.finish_reason:
                done.add(c.index)


async def _one(message):
    yield message
