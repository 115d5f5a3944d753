"""A client of the router's public API, for the CLI, tests and benchmarks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from services.common import replicas
from services.common.convert import finish_from_proto
from services.common.security import PLAINTEXT, MeshSecurity
from services.proto import common_pb2, router_pb2, router_pb2_grpc

ROUTER_SERVICE = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


def build_request(prompt: str | None = None, token_ids: list[int] | None = None, *, request_id: str = "",
                  max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                  top_k: int = 0, min_p: float = 0.0, seed: int | None = None, n: int | None = None,
                  ignore_eos: bool = False, stop_token_ids: Sequence[int] = (), stop: Sequence[str] = ()
                  ) -> router_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(top_k=top_k, min_p=min_p, ignore_eos=ignore_eos,
                                         stop_token_ids=list(stop_token_ids), stop=list(stop))
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                        ("seed", seed), ("n", n)):
        if value is not None:
            setattr(sampling, name, value)
    request = router_pb2.GenerateRequest(request_id=request_id, sampling=sampling)
    if token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    elif prompt is not None:
        request.text = prompt.encode("utf-8")
    return request


@dataclass
class Completion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)


async def stream(address: str, request: router_pb2.GenerateRequest, timeout: float | None = None,
                 security: MeshSecurity = PLAINTEXT, api_key: str | None = None
                 ) -> AsyncIterator[router_pb2.GenerateResponse]:
    """``address``: a router, or several comma-separated (``services/common/replicas.py``:
    a router that is down is skipped, and a call it failed before answering retried);
    ``security``: the router's CA for a router with TLS (no client certificate
    needed); ``api_key``: for a router that requires one."""
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    async with security.channel(replicas.target(address), replicas.options(ROUTER_SERVICE)) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        async for msg in stub.Generate(request, timeout=timeout, metadata=metadata):
            yield msg


def accumulate(completion: Completion, msg: router_pb2.GenerateResponse) -> str:
    """Fold one message into ``completion`` (sample 0); returns its new text."""
    completion.request_id = msg.request_id
    if msg.WhichOneof("kind") == "delta":
        if msg.delta.sample_index == 0:
            completion.token_ids += msg.delta.token_ids
            completion.text += msg.delta.text
            return msg.delta.text
        return ""
    if msg.finished.sample_index == 0:
        u = msg.finished.usage
        completion.finish_reason = finish_from_proto(msg.finished.finish_reason)
        completion.usage = {"prompt_tokens": u.prompt_tokens, "cached_prompt_tokens": u.cached_prompt_tokens,
                            "completion_tokens": u.completion_tokens,
                            "time_to_first_token_s": round(u.time_to_first_token_s, 4),
                            "time_per_output_token_s": round(u.time_per_output_token_s, 4)}
    return ""
