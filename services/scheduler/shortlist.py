"""The plain workers worth pricing, at fleet scale.

Of a thousand workers, a prompt's placement is decided among few: those that hold part of
the prompt or were placed on lately (the *touched*, priced in full) and the plain rest, whose
cost under the ``kv`` policy is the same formula with nothing cached:

    cost(plain) = (overlap_weight + 1) * prompt_blocks + active_blocks + eviction_weight * evicted
               >= (overlap_weight + 1) * prompt_blocks + active_blocks          (the bound)

So the plain workers are walked in order of (active blocks, id), kept once per listing, and
the walk stops at the first whose bound reaches the best cost found: none after it can win,
ties included (the ``kv`` policy breaks a tie by active blocks, then id, the walk's own
order). The touched are walked the same way by their own bound, with what they hold and
have pending, (overlap_weight + 1) * uncached blocks + active blocks, from the plain best's
cost, past every bound equal to the best (their order is not the tie's). Each role's best
plain worker and the touched ones walked go to placement: the same choice as pricing every
worker (tests/services/test_shortlist.py checks it against the full pool). Where no plain
worker that could take the request has room for its prompt, placement prices the whole
pool, as before; where a prefix may be pulled from another worker, every touched one."""

from __future__ import annotations

from typing import NamedTuple

from kervan.worker_info import WorkerRole
from services.scheduler.placement import Candidate, PlacementConfig, Size, cost, has_room


class Best(NamedTuple):
    worker: Candidate | None  # None: no plain worker of the role can take the request with room
    lacked_room: bool  # a plain worker could have taken it but has no room for the prompt
    # with no ``worker``: one that could have taken it but is at its request limit (placement tells "the pool is
    # full" from "there is no pool" by it)
    full: Candidate | None = None


def plain_order(reported: list[Candidate]) -> dict[bool, list[Candidate]]:
    """A listing's prefill workers (True) and the others, each in the walk's order (made
    once per listing)."""
    ordered = sorted(reported, key=lambda c: (c.active_blocks, c.worker_id))
    return {prefill: [c for c in ordered if (c.role is WorkerRole.PREFILL) == prefill] for prefill in (False, True)}


def best_plain(order: dict[bool, list[Candidate]], skip: set[str], num_prompt_blocks: int, cfg: PlacementConfig,
               model: str, size: Size, prefill: bool) -> Best:
    """The plain worker of one role (``prefill``: the prefill pool, else the workers that
    decode) with the lowest (cost, active blocks, id) among those that may take the
    request and have room for it. ``skip``: ids not plain here (touched, excluded, avoided)."""
    base = (cfg.overlap_weight + 1) * num_prompt_blocks
    best, best_cost, lacked_room, full = None, float("inf"), False, None
    for c in order[prefill]:
        if base + c.active_blocks >= best_cost:
            break
        if c.worker_id in skip or (model and c.model != model) or not size.fits(c):
            continue
        if c.full:
            full = full or c
            continue
        if not has_room(c, num_prompt_blocks):
            lacked_room = True
            continue
        price = cost(c, num_prompt_blocks, cfg)
        if price < best_cost:
            best, best_cost = c, price
    return Best(best, lacked_room, None if best else full)


class Touched(NamedTuple):
    bound: float  # (overlap_weight + 1) * uncached blocks + active blocks, pending included
    reported: Candidate
    held: int  # leading prompt blocks it holds or was sent lately


def walk_touched(touched: list[Touched], build, num_prompt_blocks: int, cfg: PlacementConfig, model: str,
                 size: Size, prefill: bool, best_cost: float) -> list[Candidate]:
    """The touched workers of one role that could beat ``best_cost`` (the plain best's),
    built (``build(touched)``: the candidate with what it holds and has pending), in order
    of their bound (ties by id, as pricing all sees them), until the bound passes the best
    cost found."""
    out = []
    for t in sorted((t for t in touched if (t.reported.role is WorkerRole.PREFILL) == prefill),
                    key=lambda t: (t.bound, t.reported.worker_id)):
        if t.bound > best_cost:
            break
        c = build(t)
        out.append(c)
        if c.full or (model and c.model != model) or not size.fits(c) or not has_room(c, num_prompt_blocks):
            continue
        best_cost = min(best_cost, cost(c, num_prompt_blocks, cfg))
    return out
