"""The router's OpenAI-compatible HTTP front, driven by the real ``openai`` client over
a real mesh (router and worker over gRPC, the embedded model with its tokenizer):
completions and chat, streamed and not, OpenAI-style errors with the right status, and
a client that goes away mid-stream aborts its request on the workers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request

import openai
import pytest

from kervan.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from kervan.tokenizer import Tokenizer
from services.router.http_front import OpenAIFront
from tests.services.mesh_helpers import num_aborted, wait_aborted, wait_idle


@pytest.fixture
async def front(text_mesh, default_model_dir):
    front = OpenAIFront(text_mesh.core, default_model_dir.name,
                        Tokenizer.from_dir(default_model_dir), ChatTemplate.from_dir(default_model_dir))
    port = await front.start("127.0.0.1", 0)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    yield client, port, text_mesh, default_model_dir
    await client.close()
    await front.stop()


async def test_completions_streamed_and_not_give_the_same_greedy_text(front):
    client, _, mesh, model_dir = front
    model = model_dir.name
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = await client.completions.create(**kwargs)
    assert whole.object == "text_completion" and whole.model == model and whole.id.startswith("cmpl-")
    [choice] = whole.choices
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = [c async for c in await client.completions.create(**kwargs, stream=True,
                                                                stream_options={"include_usage": True})]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12  # the usage chunk, last
    await wait_idle(mesh)


async def test_streamed_chunks_add_up_to_the_decoded_tokens_with_no_half_character(front):
    """Sampled hot, the random model emits lone bytes of multi-byte characters: the streamed
    chunks of each seeded request concatenate to ``decode`` of the tokens the same request
    gets over gRPC (the mesh is deterministic), U+FFFD only where that text has it."""
    from services.proto import common_pb2, router_pb2
    from tests.services.mesh_helpers import collect, token_ids
    client, _, mesh, model_dir = front
    tokenizer = Tokenizer.from_dir(model_dir)
    num_partial = 0
    for seed in range(4):
        chunks = [c async for c in await client.completions.create(
            model=model_dir.name, prompt="Once upon a time", max_tokens=16, temperature=1.5, seed=seed, stream=True,
            extra_body={"ignore_eos": True})]
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        deltas, _ = await collect(mesh.router, router_pb2.GenerateRequest(text=b"Once upon a time", sampling=(
            common_pb2.SamplingParams(max_tokens=16, temperature=1.5, seed=seed, ignore_eos=True))))
        ids = token_ids(deltas)
        assert streamed == tokenizer.decode(ids), seed
        num_partial += sum(tokenizer.decode([t]) == "\ufffd" for t in ids)
    assert num_partial > 0  # the streams really carried lone bytes


async def test_token_id_prompts_batches_n_and_logprobs(front):
    client, _, _, model_dir = front
    model = model_dir.name
    out = await client.completions.create(model=model, prompt=[[5, 6, 7], [8, 9]], max_tokens=4, n=2,
                                          temperature=0.8, seed=3, logprobs=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]  # prompt i's samples are 2i and 2i + 1
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 16
    for c in out.choices:
        assert len(c.logprobs.token_logprobs) == 4 and all(lp <= 0 for lp in c.logprobs.token_logprobs)


async def test_chat_streamed_and_not(front):
    client, _, _, model_dir = front
    model = model_dir.name
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    kwargs = dict(model=model, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = await client.chat.completions.create(**kwargs)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    chunks = [c async for c in await client.chat.completions.create(**kwargs, stream=True)]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    # the prompt was the chat template's rendering (ChatML: the embedded model has no template of its own)
    rendered = ChatTemplate(DEFAULT_TEMPLATE).render(messages)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and rendered.endswith("assistant\n")
    assert whole.usage.prompt_tokens == len(Tokenizer.from_dir(model_dir).encode(rendered))


async def test_errors_are_openai_json_with_the_grpc_paths_status(front):
    client, port, _, model_dir = front
    model = model_dir.name
    with pytest.raises(openai.BadRequestError) as err:  # the router's own check, through gRPC
        await client.completions.create(model=model, prompt="hi", max_tokens=5, temperature=-1)
    assert err.value.status_code == 400 and "temperature" in err.value.message
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="no-such-model", prompt="hi", max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="presence_penalty is not supported"):
        await client.completions.create(model=model, prompt="hi", presence_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="n must be an integer"):  # a type, checked before gRPC
        await client.completions.create(model=model, prompt="hi", extra_body={"n": "2"})
    with pytest.raises(openai.BadRequestError, match="needs a role"):
        await client.chat.completions.create(model=model, messages=[{"content": "hi"}])
    status, body = await http(port, "POST", "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert (await http(port, "GET", "/health"))[0] == 200
    assert (await http(port, "GET", "/v1/models"))[1]["data"][0]["id"] == model
    assert (await http(port, "GET", "/v1/completions"))[0] == 405


async def http(port: int, method: str, path: str, data: bytes | None = None, host: str = "127.0.0.1"
               ) -> tuple[int, dict | None]:
    """A plain HTTP call (urllib, off the event loop): (status, JSON body or None)."""
    def call():
        request = urllib.request.Request(f"http://{host}:{port}{path}", data=data, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, None
    return await asyncio.to_thread(call)


async def test_a_client_that_disconnects_mid_stream_aborts_the_request_on_the_workers(front):
    client, _, mesh, model_dir = front
    model = model_dir.name
    before = await num_aborted(mesh)
    stream = await client.completions.create(model=model, prompt="Once upon a time", max_tokens=2000,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True})
    received = 0
    async for _ in stream:
        received += 1
        if received == 3:
            break
    await stream.close()  # the HTTP connection goes away mid-stream
    await wait_aborted(mesh, before + 1)
    await wait_idle(mesh)  # and its KV blocks are free again


async def test_a_body_past_the_limit_is_refused_unread_and_numbers_past_their_fields_name_the_field(
        text_mesh, default_model_dir):
    front = OpenAIFront(text_mesh.core, default_model_dir.name,
                        Tokenizer.from_dir(default_model_dir), ChatTemplate.from_dir(default_model_dir),
                        max_body_bytes=64 << 10)
    port = await front.start("127.0.0.1", 0)
    try:
        status, body = await http(port, "POST", "/v1/completions", b" " * (65 << 10))  # by its Content-Length
        assert status == 413 and "larger than 65536 bytes" in body["error"]["message"]
        # 256 MiB offered as it streams in (no Content-Length): refused after the first 64 KiB; the client
        # got its answer with at most a few MiB written (what the sockets' buffers took), not 256
        before = rss_bytes()
        status_line, sent = await chunked_post(port, "/v1/completions", chunk=b" " * (1 << 20), chunks=256)
        assert status_line.startswith(b"HTTP/1.1 413") and sent < 32, (status_line, sent)
        # and the front (here, in this process) held none of it: the 300 MiB body took a router
        # from 295 MB to 2.15 GB
        assert rss_bytes() - before < 32 << 20, (before, rss_bytes())
        status, body = await http(port, "POST", "/v1/completions", b"[" * 20_000 + b"]" * 20_000)
        assert status == 400 and "nested too deeply" in body["error"]["message"]
        model = default_model_dir.name
        for field, value, extra in (("max_tokens", 2 ** 40, {}), ("n", 2 ** 33, {}), ("top_k", 2 ** 31, {}),
                                    ("seed", -1, {}), ("stop_token_ids", [2 ** 32], {}), ("prompt", [5, -1], {})):
            request = {"model": model, "prompt": "hi", **extra, field: value}
            status, body = await http(port, "POST", "/v1/completions", json.dumps(request).encode())
            assert status == 400 and field in body["error"]["message"], (field, status, body)
    finally:
        await front.stop()


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


async def chunked_post(port: int, path: str, chunk: bytes, chunks: int) -> tuple[bytes, int]:
    """POST a body of ``chunks`` chunks with chunked transfer encoding, stopping when the
    server answers or closes; returns the answer's status line and the chunks sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n".encode())
    answer = asyncio.create_task(reader.readline())
    sent = 0
    try:
        while sent < chunks and not answer.done():
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await asyncio.wait_for(writer.drain(), 30)
            sent += 1
    except (ConnectionError, OSError, TimeoutError):
        pass
    finally:
        writer.close()
    return await asyncio.wait_for(answer, 30), sent


async def test_a_router_on_a_given_address_serves_http_through_that_address(text_mesh, default_model_dir):
    """``--host 127.0.0.2``: the router's HTTP front reaches its gRPC server where that listens
    (it once dialled 127.0.0.1, where nothing does, and every request got 503)."""
    router = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.router", "--host", "127.0.0.2", "--port", "0", "--http-port", "0",
        "--worker", f"127.0.0.1:{text_mesh.workers[0].port}", "--model", str(default_model_dir),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        line = (await asyncio.wait_for(router.stdout.readline(), 120)).decode()
        assert "router HTTP (OpenAI API) on http://127.0.0.2:" in line, line
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        request = {"model": default_model_dir.name, "prompt": "Once upon a time", "max_tokens": 3}
        status, body = await http(port, "POST", "/v1/completions", json.dumps(request).encode(), host="127.0.0.2")
        assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    finally:
        router.terminate()
        assert await asyncio.wait_for(router.wait(), 30) == 0
