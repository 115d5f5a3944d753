"""Placement as a pure function of plain data (Dynamo's cost, llm-d's filters).

    cost(worker) = overlap_weight * uncached_prefill_blocks + active_blocks

Filters first (role), then the lowest cost wins (or a softmax draw when a
temperature is set). The decode worker is chosen first; a separate prefill worker
only when the uncached part of the prompt is long enough to be worth a KV
handoff and a prefill worker exists — otherwise the decode worker prefills
locally (counted as a decode-only fallback when no prefill worker was up).

Like Dynamo's conditional disaggregation, remote prefill also needs room in the
prefill pool: when even the chosen prefill worker has more than
``max_prefill_queue_tokens`` waiting and the decode worker's own queue is
shorter, the decode worker prefills (an overflow). Without it a closed loop of
clients piles up behind the prefill pool while the decode pool idles."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    address: str
    role: str  # "prefill" | "decode" | "both"
    matched_blocks: int  # leading prompt blocks it already caches
    active_blocks: int  # KV blocks its running requests hold
    prefill_tokens: int = 0  # prompt tokens queued for prefill on it


@dataclass(frozen=True)
class PlacementConfig:
    overlap_weight: float = 1.0
    temperature: float = 0.0  # 0: argmin; > 0: softmax over -cost / temperature
    min_remote_prefill_blocks: int = 2  # shorter uncached parts are prefilled by the decode worker
    max_prefill_queue_tokens: int = 2048  # a longer prefill queue overflows to the decode worker; 0: never


@dataclass(frozen=True)
class Decision:
    decode: Candidate
    prefill: Candidate | None  # None: prefill on the decode worker
    scores: dict[str, float] = field(default_factory=dict)
    fallback: bool = False  # remote prefill was wanted but no prefill worker is up
    overflow: bool = False  # remote prefill was wanted but the prefill pool's queue is full

    @property
    def cached_blocks(self) -> int:
        return (self.prefill or self.decode).matched_blocks


def cost(c: Candidate, num_prompt_blocks: int, cfg: PlacementConfig) -> float:
    return cfg.overlap_weight * max(0, num_prompt_blocks - c.matched_blocks) + c.active_blocks


def choose(pool: list[Candidate], num_prompt_blocks: int, cfg: PlacementConfig,
           rng: random.Random | None = None) -> tuple[Candidate, dict[str, float]]:
    scores = {c.worker_id: cost(c, num_prompt_blocks, cfg) for c in pool}
    if cfg.temperature <= 0:
        return min(pool, key=lambda c: (scores[c.worker_id], c.worker_id)), scores
    best = min(scores.values())
    weights = [math.exp(-(scores[c.worker_id] - best) / cfg.temperature) for c in pool]
    return (rng or random).choices(pool, weights)[0], scores


def place(candidates: list[Candidate], num_prompt_blocks: int, cfg: PlacementConfig,
          rng: random.Random | None = None) -> Decision | None:
    decoders = [c for c in candidates if c.role in ("decode", "both")]
    if not decoders:
        return None
    decode, scores = choose(decoders, num_prompt_blocks, cfg, rng)
    uncached = num_prompt_blocks - decode.matched_blocks
    if decode.role == "both" or uncached < cfg.min_remote_prefill_blocks:
        return Decision(decode, None, scores)
    prefillers = [c for c in candidates if c.role == "prefill"]
    if not prefillers:
        return Decision(decode, None, scores, fallback=True)
    prefill, prefill_scores = choose(prefillers, num_prompt_blocks, cfg, rng)
    scores = {**scores, **prefill_scores}
    if 0 < cfg.max_prefill_queue_tokens < prefill.prefill_tokens and decode.prefill_tokens < prefill.prefill_tokens:
        return Decision(decode, None, scores, overflow=True)
    return Decision(decode, prefill, scores)
