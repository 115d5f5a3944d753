"""Per-request sampling parameters, validated on construction so a bad request
fails alone, before anything is scheduled (rules follow vLLM's), and the limits a
worker serves requests within (``RequestLimits``): workers report them when they
register, the scheduler places a request only where it fits, and each engine checks
its own, all with the same rule and message."""

from __future__ import annotations

import math
from dataclasses import dataclass


class InvalidRequest(ValueError):
    """A request the engine refuses; the message names the field to fix."""


MAX_STOP_TOKEN_IDS = 64

# Why an n > 1 request is neither prefilled on another worker nor migrated
FORKED_SAMPLES = "n > 1: the samples fork from one prompt's KV on one worker"


@dataclass(frozen=True, kw_only=True)
class RequestLimits:
    """The largest request a worker serves."""

    max_model_len: int  # prompt + max_tokens, in tokens (the model's limit cut to what the KV cache holds)
    max_n: int  # samples per request

    def check(self, num_prompt_tokens: int, max_tokens: int, n: int) -> None:
        """Raises InvalidRequest naming the limit a request of this size exceeds."""
        _check(n <= self.max_n, f"n must be <= {self.max_n}, got {n}")
        _check(num_prompt_tokens + max_tokens <= self.max_model_len,
               f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the maximum model "
               f"length {self.max_model_len}")

    def allows(self, num_prompt_tokens: int, max_tokens: int, n: int) -> bool:
        return n <= self.max_n and num_prompt_tokens + max_tokens <= self.max_model_len


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-probability of each chosen token

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
               f"temperature must be finite and >= 0, got {self.temperature!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= -1,
               f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)[:8]!r}")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
               f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def check_vocabulary(self, vocab_size: int) -> None:
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        _check(not bad, f"stop_token_ids {bad[:8]} are outside the vocabulary [0, {vocab_size})")


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(message)
