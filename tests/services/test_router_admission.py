"""The router's slots: one tenant's share, counted by the key it holds however the header
spells it, given back whenever a request ends; the HTTP front, which bounds a body's
prompts and asks for room for all of them before it starts any; and the front's
connections, bounded in time and count against slow and many clients."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest

from control_plane.cli.client import build_request
from kervan.chat_template import ChatTemplate
from kervan.tokenizer import Tokenizer
from services.common.auth import ApiKey, ApiKeys
from services.common.errors import Overloaded
from services.router.admission import Admission
from services.router.http_front import OpenAIFront
from services.router.http_guard import HttpLimits, raise_open_files_limit, within_open_files
from services.router.openai_protocol import RequestBounds
from tests.services.conftest import start_mesh
from tests.services.mesh_helpers import engine_paused

KEY_A, KEY_B = "tenant-a-0123456789abcdef", "tenant-b-0123456789abcdef"


def test_the_share_of_one_key_and_the_total_are_both_limits():
    admission = Admission(3, 2)
    admission.take("a")
    admission.take("a")
    with pytest.raises(Overloaded, match="this API key has 2 requests in flight and a share of 2"):
        admission.take("a")
    admission.take("b")
    with pytest.raises(Overloaded, match="the router has 3 requests in flight and a limit of 3"):
        admission.take("c")
    assert admission.refusal("b", 1) is not None and admission.refusal("d", 0) is None
    for key in ("a", "a", "b"):
        admission.give_back(key)
    assert (admission.num_in_flight, dict(admission.per_key)) == (0, {})
    assert admission.refusal("a", 3) == "this API key has 0 requests in flight and a share of 2; retry later"


@pytest.fixture
async def keyed_mesh(llama):
    keys = ApiKeys([ApiKey(KEY_A.encode()), ApiKey(KEY_B.encode())])
    admission = Admission(3, 2)
    mesh, stop = await start_mesh(llama[1], router_options={"admission": admission, "api_keys": keys},
                                  block_size=16, num_kv_blocks=128)
    yield mesh, admission
    await stop()


async def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_one_key_cannot_take_every_slot_and_its_slots_come_back(keyed_mesh):
    mesh, admission = keyed_mesh
    a, b = (ApiKey(k.encode()).identity for k in (KEY_A, KEY_B))

    def call(header: str, max_tokens: int):
        request = build_request(token_ids=[5, 6, 7], max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return mesh.router.Generate(request, timeout=60, metadata=[("authorization", header)])

    async def drain(c) -> list:
        return [m async for m in c]

    with engine_paused(mesh):  # nothing finishes by itself meanwhile
        held = [asyncio.ensure_future(drain(call(f"Bearer {KEY_A}", 100))) for _ in range(2)]
        await _wait(lambda: admission.per_key[a] == 2)
        for header in (f"Bearer {KEY_A}", f"bearer  {KEY_A} "):  # the key is counted, not the header's text
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await drain(call(header, 2))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "this API key has 2 requests in flight and a share of 2" in err.value.details()
        held.append(asyncio.ensure_future(drain(call(f"Bearer {KEY_B}", 100))))
        await _wait(lambda: admission.per_key[b] == 1)  # the other tenant is admitted beside them
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
    await _wait(lambda: admission.num_in_flight == 0)  # cancelled: every slot given back
    assert dict(admission.per_key) == {}
    assert len(await drain(call(f"Bearer {KEY_A}", 2))) >= 2


def _post(port: int, body: dict | bytes, timeout: float = 30) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), {k.lower(): v for k, v in err.headers.items()}


@pytest.fixture
async def bounded_front(text_mesh, default_model_dir):
    admission = text_mesh.core.admission = Admission(4)  # the router's slots, which gRPC and HTTP share
    front = OpenAIFront(text_mesh.core, default_model_dir.name,
                        Tokenizer.from_dir(default_model_dir), ChatTemplate.from_dir(default_model_dir),
                        bounds=RequestBounds(max_prompts=8, max_samples=12))
    port = await front.start("127.0.0.1", 0)
    yield port, admission, default_model_dir.name
    await front.stop()


async def test_a_body_of_many_prompts_is_refused_before_any_starts(bounded_front):
    """20,000 one-token prompts (100 KB) once started 20,000 calls on the router's loop: 734 MB
    of RSS and its health stalled 8 s. Now: 400 naming the limit, and nothing was started."""
    port, admission, model = bounded_front
    status, body, _ = await asyncio.to_thread(_post, port, {"model": model, "prompt": [[5]] * 20_000, "max_tokens": 1})
    assert status == 400 and "prompt holds 20000 prompts; at most 8 per request" in body["error"]["message"]
    status, body, _ = await asyncio.to_thread(_post, port, {"model": model, "prompt": [[5]] * 4, "n": 4,
                                                            "max_tokens": 1})
    assert status == 400 and "4 prompts x n=4 is 16 samples; at most 12 per request" in body["error"]["message"]
    assert admission.num_in_flight == 0


async def test_a_body_whose_prompts_do_not_all_fit_the_slots_gets_429_and_starts_none(bounded_front):
    port, admission, model = bounded_front
    for _ in range(2):
        admission.take("")  # two slots held, as by two gRPC streams of the same router
    try:
        status, body, headers = await asyncio.to_thread(_post, port, {"model": model, "prompt": [[5]] * 3,
                                                                      "max_tokens": 1})
        assert status == 429 and body["error"]["type"] == "rate_limit_error"
        assert "requests in flight and a limit of 4" in body["error"]["message"] and headers["retry-after"] == "1"
        assert admission.num_in_flight == 2  # none of the three started
        status, body, _ = await asyncio.to_thread(_post, port, {"model": model, "prompt": [[5]] * 2, "max_tokens": 1})
        assert status == 200 and len(body["choices"]) == 2
    finally:
        admission.give_back("")
        admission.give_back("")


@pytest.fixture
async def guarded_front(text_mesh, default_model_dir):
    limits = HttpLimits(header_timeout_s=1.0, body_timeout_s=1.0, max_connections=60, max_per_client=40)
    front = OpenAIFront(text_mesh.core, default_model_dir.name,
                        Tokenizer.from_dir(default_model_dir), ChatTemplate.from_dir(default_model_dir),
                        http_limits=limits)
    port = await front.start("127.0.0.1", 0)
    yield port, front
    await front.stop()


def _slow_client(port: int, source: str, first: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    s.sendall(first)
    return s


def _closed_by_server(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        return s.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _health(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
        return resp.status


async def test_slow_and_many_connections_are_closed_and_health_answers_throughout(guarded_front):
    """Slowloris: connections that never finish their headers (or body) once stayed open for
    good, 1,100 of them took the router to 929 fds and reset /health. Now each is closed at its
    deadline, one address holds at most its share, and /health answers meanwhile."""
    port, front = guarded_front
    headers = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "
    body = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    fds_before = len(os.listdir("/proc/self/fd"))
    slow = [await asyncio.to_thread(_slow_client, port, "127.0.0.2", headers if i % 2 else body) for i in range(50)]
    try:
        refused = [s for s in slow[40:] if await asyncio.to_thread(_closed_by_server, s, 0.5)]
        assert len(refused) == 10 and front.connections.num_refused >= 10  # past the address's share
        assert front.connections.per_client["127.0.0.2"] == 40
        assert await asyncio.to_thread(_health, port) == 200  # another address, while they hang
        closed = [await asyncio.to_thread(_closed_by_server, s, 3.0) for s in slow[:40]]
        assert all(closed) and front.connections.num_timed_out == 40  # headers and bodies past their deadlines
        assert front.connections.total == 0 and len(os.listdir("/proc/self/fd")) <= fds_before + 55
    finally:
        for s in slow:
            s.close()
    assert await asyncio.to_thread(_health, port) == 200


def test_the_open_files_limit_bounds_the_connections():
    limits = HttpLimits(max_connections=1000, max_per_client=100)
    assert within_open_files(limits, 1024) == HttpLimits(10.0, 30.0, 512, 100)
    assert within_open_files(limits, 1 << 20) is limits
    assert raise_open_files_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def test_a_refusal_or_failure_of_the_core_answers_with_the_status_grpc_would_give():
    """The front calls the router's core in-process: a cancelled request is 503 (retry), never
    500; a refusal keeps its status and Retry-After; an unexpected error is 500."""
    import grpc

    from kervan.sampling import InvalidRequest
    from services.common.errors import Overloaded
    from services.router.core import MeshFailure
    from services.router.http_front import failure_response
    assert failure_response(MeshFailure(grpc.StatusCode.CANCELLED, "stopping")).status_code == 503
    assert failure_response(MeshFailure(grpc.StatusCode.UNAVAILABLE, "no worker")).status_code == 503
    busy = failure_response(Overloaded("full", 2.0))
    assert busy.status_code == 429 and busy.headers["retry-after"] == "2"
    assert failure_response(InvalidRequest("bad")).status_code == 400
    assert failure_response(KeyError("bug")).status_code == 500
