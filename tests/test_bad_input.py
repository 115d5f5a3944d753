"""A catalog of malformed requests against the running process mesh: each gets the
right status (never INTERNAL) and a message naming what to fix; afterwards every
worker's KV is back to idle and a normal request still succeeds.

Negative token ids, max_tokens or n cannot be sent: the fields are unsigned, and a
negative int32 on the wire decodes as a number above 2**32 - 2**31, which the
catalog covers as "beyond the vocabulary / context / limit"."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from control_plane.cli.client import build_request
from services.proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.cluster_helpers import complete, wait_idle

INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
VOCAB, CONTEXT = 128, 512  # the tiny llama of tests/conftest.py


def ids(*token_ids, **sampling) -> router_pb2.GenerateRequest:
    return build_request(token_ids=list(token_ids or [5, 6, 7]), **sampling)


def with_sampling(**fields) -> router_pb2.GenerateRequest:
    request = ids()
    for name, value in fields.items():
        setattr(request.sampling, name, value)
    return request


def raw(**fields) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(**fields)


def with_stop(*stop) -> router_pb2.GenerateRequest:
    request = ids()
    request.sampling.stop.extend(stop)
    return request


ROUTER_CATALOG = [  # (case, request, status, words the message must contain)
    ("no prompt", raw(), INVALID, "prompt"),
    ("empty text", raw(text=b""), INVALID, "prompt"),
    ("empty token ids", raw(token_ids=common_pb2.TokenIds()), INVALID, "prompt"),
    ("invalid UTF-8", raw(text=b"caf\xe9 \xff"), INVALID, "prompt.text"),
    ("truncated UTF-8", raw(text=b"euro \xe2\x82"), INVALID, "prompt.text"),
    ("lone surrogate bytes", raw(text=b"\xed\xa0\x80"), INVALID, "prompt.text"),
    ("text without a tokenizer", raw(text=b"hello"), INVALID, "tokenizer"),
    ("token id = vocabulary size", ids(5, VOCAB), INVALID, "prompt.token_ids"),
    ("token id 2**32-1 (a negative int32)", ids(2**32 - 1), INVALID, "prompt.token_ids"),
    ("prompt longer than the context", ids(*[5] * (CONTEXT + 1)), INVALID, "maximum model length"),
    ("prompt exactly the context", ids(*[5] * CONTEXT), INVALID, "maximum model length"),
    ("max_tokens 0", ids(max_tokens=0), INVALID, "max_tokens"),
    ("max_tokens beyond the context", ids(max_tokens=CONTEXT), INVALID, "max_tokens"),
    ("max_tokens 2**32-1", ids(max_tokens=2**32 - 1), INVALID, "max_tokens"),
    ("temperature negative", ids(temperature=-0.5), INVALID, "temperature"),
    ("temperature NaN", ids(temperature=math.nan), INVALID, "temperature"),
    ("temperature infinite", ids(temperature=math.inf), INVALID, "temperature"),
    ("top_p 0", ids(top_p=0.0), INVALID, "top_p"),
    ("top_p above 1", ids(top_p=1.5), INVALID, "top_p"),
    ("top_p negative", ids(top_p=-0.1), INVALID, "top_p"),
    ("top_p NaN", ids(top_p=math.nan), INVALID, "top_p"),
    ("top_k -2", ids(top_k=-2), INVALID, "top_k"),
    ("top_k most negative", ids(top_k=-2**31), INVALID, "top_k"),
    ("min_p negative", ids(min_p=-0.1), INVALID, "min_p"),
    ("min_p above 1", ids(min_p=1.01), INVALID, "min_p"),
    ("min_p NaN", with_sampling(min_p=math.nan), INVALID, "min_p"),
    ("n 0", ids(n=0), INVALID, "n"),
    ("n huge", ids(n=1_000_000), INVALID, "n must be"),
    ("n just over the limit", ids(n=65), INVALID, "n must be"),
    ("seed beyond 2**63", ids(seed=2**64 - 1), INVALID, "seed"),
    ("stop id outside the vocabulary", ids(stop_token_ids=[VOCAB]), INVALID, "stop_token_ids"),
    ("stop id 2**32-1", ids(stop_token_ids=[2**32 - 1]), INVALID, "stop_token_ids"),
    ("too many stop ids", ids(stop_token_ids=list(range(100))), INVALID, "stop_token_ids"),
    ("empty stop string", with_stop("a", ""), INVALID, "sampling.stop"),
    ("17 stop strings", with_stop(*"abcdefghijklmnopq"), INVALID, "sampling.stop"),
    ("stop string of 257 characters", with_stop("x" * 257), INVALID, "sampling.stop"),
    ("stop strings without a tokenizer", with_stop("the end"), INVALID, "tokenizer"),
    ("unknown model", raw(token_ids=common_pb2.TokenIds(ids=[5]), model="gpt-17"), NOT_FOUND, "model"),
    ("request id too long", raw(request_id="r" * 129, token_ids=common_pb2.TokenIds(ids=[5])), INVALID,
     "request_id"),
    ("request id with a slash", raw(request_id="../etc", token_ids=common_pb2.TokenIds(ids=[5])), INVALID,
     "request_id"),
    ("request id with a newline", raw(request_id="a\nb", token_ids=common_pb2.TokenIds(ids=[5])), INVALID,
     "request_id"),
    ("oversized message (5 MB)", raw(text=b"a" * 5_000_000), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "larger than max"),
]


class Accepted(AssertionError):
    """A request the test expected to be refused was answered."""


async def expect(call, status, words):
    try:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as err:
        assert err.code() == status, f"{err.code()} {err.details()}"
        assert err.code() != grpc.StatusCode.INTERNAL
        assert words.lower() in (err.details() or "").lower(), err.details()
        return
    raise Accepted(f"accepted; expected {status.name}")


@pytest.mark.parametrize("case,request_,status,words", ROUTER_CATALOG, ids=[c[0] for c in ROUTER_CATALOG])
async def test_router_refuses(cluster, case, request_, status, words):
    async with grpc.aio.insecure_channel(cluster.router_address) as ch:
        await expect(lambda: router_pb2_grpc.RouterServiceStub(ch).Generate(request_, timeout=30), status, words)


async def test_a_duplicate_in_flight_request_id_is_refused(cluster):
    """A second request with the id of one still streaming is refused. The first asks for
    most of the context, so it is normally still streaming when the duplicate arrives; on a
    loaded machine it can end first, and then its id is free again and taking the second is
    right. So each accepted try starts over with a new id: a router that never refuses
    duplicates is accepted on every try and fails."""
    async with grpc.aio.insecure_channel(cluster.router_address) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        for attempt in range(3):
            rid = f"dup-{attempt}"
            first = stub.Generate(build_request(token_ids=[5] * 20, request_id=rid, max_tokens=CONTEXT - 40,
                                                temperature=0.0, ignore_eos=True), timeout=60)
            await first.read()  # in flight now
            try:
                await expect(lambda rid=rid: stub.Generate(build_request(token_ids=[6], request_id=rid), timeout=30),
                             grpc.StatusCode.ALREADY_EXISTS, "request_id")
                return
            except Accepted:
                continue
            finally:
                first.cancel()
        raise AssertionError("a duplicate of a streaming request's id was accepted on 3 tries")


WORKER_CATALOG = [  # malformed internal calls straight at the workers: (worker, call, request, status, words)
    ("decode-0", "Prefill", worker_pb2.PrefillRequest(request_id="x", prompt=common_pb2.TokenIds(ids=[5])),
     grpc.StatusCode.FAILED_PRECONDITION, "role"),
    ("prefill-0", "Decode", worker_pb2.DecodeRequest(request_id="x"), grpc.StatusCode.FAILED_PRECONDITION, "role"),
    ("prefill-0", "Prefill", worker_pb2.PrefillRequest(request_id="x", prompt=common_pb2.TokenIds(ids=[5] * 20)),
     INVALID, "decode_address"),
    ("decode-0", "Decode", worker_pb2.DecodeRequest(request_id="x", prompt=common_pb2.TokenIds(ids=[5] * 20),
                                                    kv_handle="no-such-handle"), INVALID, "kv_handle"),
    ("decode-0", "Execute", worker_pb2.ExecuteRequest(request_id="x", prompt=common_pb2.TokenIds(ids=[VOCAB + 3])),
     INVALID, "vocabulary"),
    ("prefill-0", "FetchKv", worker_pb2.FetchKvRequest(block_hashes=[b"short"]), INVALID, "32-byte"),
    ("decode-0", "FetchKv", worker_pb2.FetchKvRequest(block_hashes=[bytes(32)] * 65537), INVALID, "at most"),
]


@pytest.mark.parametrize("worker,method,request_,status,words", WORKER_CATALOG,
                         ids=[f"{c[0]}.{c[1]}:{c[4]}" for c in WORKER_CATALOG])
async def test_worker_refuses(cluster, worker, method, request_, status, words):
    async with grpc.aio.insecure_channel(cluster.addresses[worker]) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        await expect(lambda: getattr(stub, method)(request_, timeout=30), status, words)


async def test_push_kv_refuses_foreign_segments_and_bad_headers(cluster):
    digest = b"\0" * 32
    bad_headers = [
        (worker_pb2.KvHeader(request_id="x", shm_name="/dev/shm/../etc/passwd", num_bytes=8,
                             dtype="bfloat16", shape=[8], prompt_digest=digest), "shm_name"),
        (worker_pb2.KvHeader(request_id="x", shm_name="kervan-kv-missing", num_bytes=8,
                             dtype="bfloat16", shape=[4], prompt_digest=digest), "does not exist"),
        (worker_pb2.KvHeader(request_id="x", num_bytes=1 << 40, dtype="bfloat16", shape=[1], prompt_digest=digest),
         "exceeds"),
        (worker_pb2.KvHeader(request_id="x", num_bytes=8, dtype="bfloat16", shape=[4]), "digest"),
    ]
    async with grpc.aio.insecure_channel(cluster.addresses["decode-0"]) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        for head, words in bad_headers:
            async def one(head=head):
                yield worker_pb2.PushKvRequest(header=head)
            await expect(lambda: stub.PushKv(one(), timeout=30), INVALID, words)

        async def pickle_dtype():  # only raw tensors of allow-listed dtypes; never pickle
            yield worker_pb2.PushKvRequest(header=worker_pb2.KvHeader(request_id="x", num_bytes=4, dtype="object",
                                                                      shape=[1], prompt_digest=digest))
            yield worker_pb2.PushKvRequest(chunk=b"\x80\x04N.")
        await expect(lambda: stub.PushKv(pickle_dtype(), timeout=30), INVALID, "dtype")


async def test_after_the_catalog_kv_is_idle_and_a_normal_request_succeeds(cluster):
    await wait_idle(cluster)
    out = await complete(cluster, token_ids=[5, 6, 7, 8] * 5, max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    await asyncio.sleep(0)
    await wait_idle(cluster)
