"""Router -> worker over real gRPC on loopback, with the real engine."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.proto import common_pb2, router_pb2, worker_pb2
from tests.conftest import hf_greedy, make_engine, make_prompts
from tests.services.conftest import start_mesh
from tests.services.mesh_helpers import (
    collect,
    engine_paused,
    greedy,
    num_aborted,
    token_ids,
    wait_aborted,
    wait_idle,
    wait_inactive,
)
from worker import SamplingParams


async def test_greedy_through_router_equals_engine_and_transformers(llama, llama_mesh):
    hf, path = llama
    prompts = make_prompts([23, 9], seed=21)  # longer than one block, and shorter
    engine_out = make_engine(path).generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for prompt, expected in zip(prompts, engine_out):
        deltas, [fin] = await collect(llama_mesh.router, router_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=prompt), sampling=greedy(10)))
        assert token_ids(deltas) == expected.token_ids == hf_greedy(hf, prompt, 10)
        indices = [d.delta.index for d in deltas]
        assert indices == sorted(indices) and indices[0] == 0  # contiguous, in order
        assert fin.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
        usage = fin.finished.usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 10)
        assert usage.time_to_first_token_s > 0
    await wait_idle(llama_mesh)


async def test_shared_prefix_reports_cached_prompt_tokens(llama_mesh):
    shared = make_prompts([20], seed=22)[0]
    await collect(llama_mesh.router, router_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=shared + [7, 8]), sampling=greedy(4)))
    _, [fin] = await collect(llama_mesh.router, router_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=shared + [9]), sampling=greedy(4)))
    assert fin.finished.usage.cached_prompt_tokens == 20


async def test_a_cache_salt_keeps_one_tenants_prefix_cache_from_another(llama_mesh):
    """A cached prompt is reused, and its cache hit reported, only for the same salt: a
    client cannot learn from cached_prompt_tokens what another tenant asked."""
    shared = make_prompts([20], seed=24)[0]

    async def cached(salt: str, tail: int) -> int:
        _, [fin] = await collect(llama_mesh.router, router_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=shared + [tail]), sampling=greedy(4), cache_salt=salt))
        return fin.finished.usage.cached_prompt_tokens

    assert await cached("tenant-a", 7) == 0
    assert await cached("tenant-b", 8) == 0  # the same prompt, another tenant: no hit
    assert await cached("", 9) == 0
    assert await cached("tenant-a", 10) == 20
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await cached("s" * 257, 11)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in refused.value.details()
    await wait_idle(llama_mesh)


async def test_concurrent_streams_all_finish_with_their_lengths(llama_mesh):
    prompts = make_prompts([5 + i % 17 for i in range(32)], seed=23)

    async def one(i, prompt):
        deltas, [fin] = await collect(llama_mesh.router, router_pb2.GenerateRequest(
            request_id=f"c{i}", token_ids=common_pb2.TokenIds(ids=prompt), sampling=greedy(3 + i % 8)))
        return len(token_ids(deltas)), fin.finished.usage.completion_tokens, fin.request_id

    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    assert results == [(3 + i % 8, 3 + i % 8, f"c{i}") for i in range(32)]
    await wait_idle(llama_mesh)


async def test_cancel_mid_stream_aborts_on_the_worker_and_frees_every_block(llama_mesh):
    before = await num_aborted(llama_mesh)
    call = llama_mesh.router.Generate(router_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=make_prompts([30], seed=24)[0]), sampling=greedy(400)))
    got = 0
    async for msg in call:
        got += len(msg.delta.token_ids)
        if got >= 3:
            break
    with engine_paused(llama_mesh):  # the request cannot finish on its own meanwhile
        held = [(await w.stub.GetLoad(worker_pb2.GetLoadRequest())).load for w in llama_mesh.workers]
        assert held[-1].num_free_blocks < held[-1].num_blocks  # the (decode) worker still holds blocks
        call.cancel()
        await wait_inactive(llama_mesh)
    await wait_aborted(llama_mesh, before + 1)
    await wait_idle(llama_mesh)


async def test_text_prompt_streams_text(text_mesh, default_model_dir):
    from kervan.tokenizer import Tokenizer
    deltas, [fin] = await collect(text_mesh.router, router_pb2.GenerateRequest(
        text=b"Once upon a time", sampling=common_pb2.SamplingParams(max_tokens=20, seed=5)))
    ids = token_ids(deltas)
    assert "".join(d.delta.text for d in deltas) == Tokenizer.from_dir(default_model_dir).decode(ids)
    assert fin.finished.usage.prompt_tokens == len(Tokenizer.from_dir(default_model_dir).encode("Once upon a time"))


async def test_streamed_text_adds_up_to_the_decoded_tokens_with_no_half_character(text_mesh, default_model_dir):
    """Sampled at temperature 1.5 the random model emits lone bytes of multi-byte characters:
    across 48 streams (two samples each, several tokens a message when the stream lags) the
    deltas concatenate to ``decode(all ids)``, and no delta ends in U+FFFD unless that
    character is still U+FFFD in the whole text, i.e. nothing partial is printed early."""
    from kervan.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_dir(default_model_dir)
    prompts = ["Once upon a time", "The caravan", "caf\u00e9 \u4e16", "A", "Prefill workers read long prompts"]

    async def one(k: int):
        sampling = common_pb2.SamplingParams(max_tokens=24 + k % 9, temperature=1.5, seed=k, n=2)
        return await collect(text_mesh.router, router_pb2.GenerateRequest(
            text=prompts[k % len(prompts)].encode(), sampling=sampling))
    results = await asyncio.gather(*(one(k) for k in range(48)))
    num_partial = 0
    for deltas, fins in results:
        assert len(fins) == 2
        for sample in (0, 1):
            mine = [d.delta for d in deltas if d.delta.sample_index == sample]
            ids = [t for d in mine for t in d.token_ids]
            whole = tokenizer.decode(ids)
            streamed = ""
            for d in mine:
                streamed += d.text
                if d.text.endswith("\ufffd"):
                    assert whole[len(streamed) - 1] == "\ufffd"
            assert streamed == whole
            num_partial += sum(tokenizer.decode([t]) == "\ufffd" for t in ids)
    assert num_partial > 20  # the streams really carried lone bytes


BAD_INPUT = [  # (request fields, words the message must contain): the router refuses, or for n and
    # the length (the limits a worker registers) the worker refuses before it admits the request
    ({"text": b"\xff\xfe bad"}, "UTF-8"),
    ({"token_ids": common_pb2.TokenIds(ids=[])}, "prompt is empty"),
    ({}, "prompt is missing"),
    ({"token_ids": common_pb2.TokenIds(ids=[3, 128])}, "outside the vocabulary"),
    ({"token_ids": common_pb2.TokenIds(ids=[3]), "sampling": common_pb2.SamplingParams(max_tokens=0)}, "max_tokens"),
    ({"token_ids": common_pb2.TokenIds(ids=[3]), "sampling": common_pb2.SamplingParams(temperature=float("nan"))},
     "temperature"),
    ({"token_ids": common_pb2.TokenIds(ids=[3]), "sampling": common_pb2.SamplingParams(top_p=1.5)}, "top_p"),
    ({"token_ids": common_pb2.TokenIds(ids=[3]), "sampling": common_pb2.SamplingParams(n=10_000)}, "n must"),
    ({"token_ids": common_pb2.TokenIds(ids=[3] * 500), "sampling": common_pb2.SamplingParams(max_tokens=100)},
     "maximum model length"),
]


async def test_bad_input_is_invalid_argument_naming_the_field(llama):
    mesh, stop = await start_mesh(llama[1])  # one mesh shape: none of these reaches an engine
    try:
        for request_kwargs, field in BAD_INPUT:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(mesh.router, router_pb2.GenerateRequest(**request_kwargs))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert field in err.value.details()
        await wait_idle(mesh)
        # and the mesh still serves
        deltas, _ = await collect(mesh.router, router_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=[3, 4, 5]), sampling=greedy(2)))
        assert len(token_ids(deltas)) == 2
    finally:
        await stop()


async def test_n_samples_stream_each_sample_to_its_end(llama_mesh):
    deltas, finished = await collect(llama_mesh.router, router_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=make_prompts([40], seed=25)[0]),
        sampling=common_pb2.SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=3, ignore_eos=True)))
    assert sorted(f.finished.sample_index for f in finished) == [0, 1, 2]
    assert [len(token_ids(deltas, s)) for s in range(3)] == [5, 5, 5]
    await wait_idle(llama_mesh)


async def test_deadline_is_passed_on_and_expiry_aborts_the_request(llama_mesh):
    before = await num_aborted(llama_mesh)
    call = llama_mesh.router.Generate(router_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=make_prompts([30], seed=26)[0]), sampling=greedy(400)), timeout=3)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for msg in call:
            if msg.delta.token_ids:
                break
        with engine_paused(llama_mesh):  # past the deadline with the request unfinished
            async for _ in call:
                pass
            await wait_inactive(llama_mesh)  # the deadline reached the worker's call too
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_aborted(llama_mesh, before + 1)
    await wait_idle(llama_mesh)


async def test_a_stop_string_ends_the_text_before_it_and_the_workers_stop(text_mesh):
    def request(stop=(), max_tokens=60):
        return router_pb2.GenerateRequest(text=b"Once upon a time", sampling=common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=list(stop)))

    deltas, [fin] = await collect(text_mesh.router, request())
    full = "".join(d.delta.text for d in deltas)
    stop = full[12:15]  # a piece of the greedy text; the output must end right before its first occurrence
    assert len(full) > 20 and stop
    before = await num_aborted(text_mesh)
    # the worker is still far from its max_tokens when the router sees the stop string
    deltas, [fin] = await collect(text_mesh.router, request([stop, "\x00never"], max_tokens=1000))
    assert "".join(d.delta.text for d in deltas) == full[:full.index(stop)]
    assert fin.finished.finish_reason == common_pb2.FINISH_REASON_STOP
    assert fin.finished.usage.completion_tokens < 60
    await wait_aborted(text_mesh, before + 1)  # the rest of the request was cancelled on the worker
    await wait_idle(text_mesh)


def test_stop_watch_holds_back_what_could_start_a_stop_string():
    from services.router.stop_strings import StopWatch
    watch = StopWatch(["END", "xy"])
    assert watch.feed("abcE", False) == ("ab", False)  # "cE" could begin "END"
    assert watch.feed("N", False) == ("c", False)  # "EN" still could
    assert watch.feed("Dzz", False) == ("", True)  # it was: nothing of it is ever streamed
    watch = StopWatch(["END"])
    assert watch.feed("hello E", False) == ("hello", False) and watch.feed("", True) == (" E", False)


async def test_a_text_too_long_for_the_context_is_refused_before_it_is_tokenized(text_mesh, default_model_dir):
    """3 MB of text cannot fit the model's context whatever the tokens: refused from its
    length in bytes and the longest token's, without spending the event loop on encoding
    it (encoding it first took seconds with every other request on the router waiting)."""
    from kervan.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_dir(default_model_dir)
    calls = []
    router = text_mesh  # the mesh's router servicer is reached over gRPC; count encodes through the class
    real = Tokenizer.encode
    Tokenizer.encode = lambda self, text: calls.append(len(text)) or real(self, text)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(router.router, router_pb2.GenerateRequest(text=b"a" * 3_000_000, sampling=greedy(4)))
    finally:
        Tokenizer.encode = real
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "maximum model length" in refused.value.details() and calls == []
    assert tokenizer.max_token_bytes >= 1
