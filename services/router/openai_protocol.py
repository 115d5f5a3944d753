"""OpenAI's completion and chat bodies <-> Kervan's GenerateRequest and responses.

Requests are checked for form here (types, what Kervan does not serve) and turned
into ``GenerateRequest``s; the values (temperature, max_tokens against the context,
stop strings, token ids) are checked by the router's gRPC path, so the HTTP front
refuses exactly what a gRPC client is refused. Extensions vLLM also takes:
``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``.

What is refused rather than silently ignored: ``echo``, ``suffix``, penalties other
than 0, ``logit_bias``, ``best_of`` other than ``n``, ``logprobs`` beyond the sampled
token's (completions ``logprobs`` 0 or 1, chat ``top_logprobs`` 0), tools and
response formats. Every integer is bounded by the protobuf field it fills before it is
set (a 400 naming the field, never protobuf's ValueError as a 500). One body's work is bounded
before any starts (``RequestBounds``): prompts per body, and prompts x n."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeGuard

from kervan.sampling import InvalidRequest
from services.proto import common_pb2, router_pb2

UINT32, UINT64 = (1 << 32) - 1, (1 << 64) - 1
INT32 = (-(1 << 31), (1 << 31) - 1)
# one body's work, bounded before any of it starts (a 4 MiB body holds ~800k one-token prompts)
MAX_PROMPTS = 256  # prompts in one completions body
MAX_SAMPLES = 1024  # prompts x n: the calls and streams one body may start (the router's default slots)
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "suffix", "logit_bias")


@dataclass(frozen=True)
class RequestBounds:
    max_prompts: int = MAX_PROMPTS
    max_samples: int = MAX_SAMPLES


DEFAULT_BOUNDS = RequestBounds()


@dataclass
class OpenAIRequest:
    """One HTTP request: a GenerateRequest per prompt and how to answer."""

    model: str
    prompts: list[router_pb2.GenerateRequest]
    n: int
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    logprobs: bool = False


@dataclass
class Choice:
    """What one sample produced, accumulated over its deltas."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


def parse_completion(body: dict, served_model: str, bounds: RequestBounds = DEFAULT_BOUNDS) -> OpenAIRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and len(prompt) > bounds.max_prompts:
        raise InvalidRequest(f"prompt holds {len(prompt)} prompts; at most {bounds.max_prompts} per request")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise InvalidRequest("prompt must be a string, a list of token ids, or a non-empty list of either")
    prompts = [p if isinstance(p, str) else _ids(p, "prompt") for p in prompts]
    if body.get("echo"):
        raise InvalidRequest("echo is not supported")
    logprobs = _int(body, "logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= 1:
        raise InvalidRequest("logprobs may be 0 or 1: Kervan returns the sampled token's log-probability only")
    return _request(body, served_model, prompts, logprobs is not None, "max_tokens", bounds)


def parse_chat(body: dict, served_model: str, render, bounds: RequestBounds = DEFAULT_BOUNDS) -> OpenAIRequest:
    """``render``: messages -> the prompt text (the model's chat template)."""
    if _int(body, "top_logprobs", 0):
        raise InvalidRequest("top_logprobs must be 0: Kervan returns the sampled token's log-probability only")
    prompt = render(body.get("messages"))
    return _request(body, served_model, [prompt], _bool(body, "logprobs", False), "max_completion_tokens", bounds)


def _request(body: dict, served_model: str, prompts: list, logprobs: bool, max_tokens_key: str,
             bounds: RequestBounds) -> OpenAIRequest:
    for key in UNSUPPORTED:
        if body.get(key) not in (None, {}, [], ""):
            raise InvalidRequest(f"{key} is not supported")
    for key in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if _number(body, key, None) not in (None, 0.0, 1.0 if key == "repetition_penalty" else 0.0):
            raise InvalidRequest(f"{key} is not supported (only its neutral value)")
    n = _int(body, "n", 1, 0, UINT32)
    if len(prompts) * n > bounds.max_samples:
        raise InvalidRequest(f"{len(prompts)} prompts x n={n} is {len(prompts) * n} samples; at most "
                             f"{bounds.max_samples} per request")
    best_of = _int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise InvalidRequest("best_of must equal n (Kervan returns every sample it draws)")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequest("stop must be a string or a list of strings")
    sampling = common_pb2.SamplingParams(top_k=_int(body, "top_k", 0, *INT32), min_p=_number(body, "min_p", 0.0),
                                         ignore_eos=_bool(body, "ignore_eos", False), logprobs=logprobs,
                                         stop=stop, stop_token_ids=_ids(body.get("stop_token_ids") or []),
                                         n=n)
    max_tokens = _int(body, max_tokens_key, None, 0, UINT32)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None, 0, UINT32)
    for name, value in (("max_tokens", max_tokens), ("temperature", _number(body, "temperature", None)),
                        ("top_p", _number(body, "top_p", None)), ("seed", _int(body, "seed", None, 0, UINT64))):
        if value is not None:
            setattr(sampling, name, value)
    model = body.get("model") or served_model
    if not isinstance(model, str):
        raise InvalidRequest("model must be a string")
    salt = body.get("cache_salt") or ""  # vLLM's name for it
    if not isinstance(salt, str):
        raise InvalidRequest("cache_salt must be a string")
    requests = []
    for prompt in prompts:
        request = router_pb2.GenerateRequest(sampling=sampling, model=model, cache_salt=salt)
        if isinstance(prompt, str):
            request.text = prompt.encode("utf-8")
        else:
            request.token_ids.ids.extend(prompt)
        requests.append(request)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object")
    return OpenAIRequest(model=model, prompts=requests, n=n, stream=_bool(body, "stream", False),
                         include_usage=bool(options.get("include_usage")), logprobs=logprobs)


def usage(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_logprobs(tokens: list[str], logprobs: list[float]) -> dict:
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": None}


def chat_logprobs(tokens: list[str], logprobs: list[float]) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                        for t, lp in zip(tokens, logprobs)]}


def _is_ids(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _ids(value: object, name: str = "stop_token_ids") -> list[int]:
    if value == []:
        return []
    if not _is_ids(value) or min(value) < 0 or max(value) > UINT32:
        raise InvalidRequest(f"{name} must be a list of token ids, each in [0, {UINT32}]")
    return value


def _int(body: dict, key: str, default, low: int | None = None, high: int | None = None):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{key} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise InvalidRequest(f"{key} must be in [{low}, {high}], got {value}")
    return value


def _number(body: dict, key: str, default):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{key} must be a number, got {value!r}")
    return float(value)


def _bool(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{key} must be true or false, got {value!r}")
    return value
