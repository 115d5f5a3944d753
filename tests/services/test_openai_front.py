"""The router's OpenAI-compatible HTTP front, driven by the real ``openai`` client over
a real mesh (router and worker over gRPC, the embedded model with its tokenizer):
completions and chat, streamed and not, OpenAI-style errors with the right status, and
a client that goes away mid-stream aborts its request on the workers."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest

from kervan.tokenizer import Tokenizer
from services.router.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from services.router.http_front import OpenAIFront
from tests.services.mesh_helpers import num_aborted, wait_aborted, wait_idle


@pytest.fixture
async def front(text_mesh, default_model_dir):
    front = OpenAIFront(f"127.0.0.1:{text_mesh.router_port}", default_model_dir.name,
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


async def http(port: int, method: str, path: str, data: bytes | None = None) -> tuple[int, dict | None]:
    """A plain HTTP call (urllib, off the event loop): (status, JSON body or None)."""
    def call():
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
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
