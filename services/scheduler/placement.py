"""Placement as a pure function of plain data (Dynamo's cost, llm-d's filters).

    cost(worker) = overlap_weight * uncached_prefill_blocks + active_blocks_after

where ``active_blocks_after`` is the KV the worker's requests hold once this one
joins them: what it holds now plus the prompt blocks it does not cache (cached
ones are shared, as in Dynamo's active-sequence accounting). A miss thus costs
its blocks twice, as prefill work and as memory, and a worker already holding
the prefix keeps winning until it is really busier. A last term,
``eviction_weight * evicted_blocks``, counts the cached blocks the new ones would
push out where the worker has too few empty blocks: a new prefix goes where it
destroys no other (it is the same everywhere once every cache is full). A matched
block a worker holds in its host tier rather than its pool is copied back, not
computed: it counts ``host_block_cost`` (a share of an uncached block) as work, and a
whole block as memory; one only on its disk tier is read back, at ``disk_block_cost``.

Filters first (role; model; the request's size: only workers whose registered
limits hold it, and none at all is the client's mistake, ``InvalidRequest``;
admission: a worker at its request limit gets no more; room for the prompt's
blocks: when no worker has room the request queues on the cheapest rather than
fail here), then the lowest cost wins (or a softmax draw when a temperature is
set) — that is the ``kv`` policy; the choice among the filtered workers is a
``PlacementPolicy`` (``services/scheduler/policies/``, one file each), and the others
(``round_robin``, ``random``, ``prefix_hash``, ``approx_tree``) ignore the cost: they are
the baselines the placement benchmark measures it against. The decode worker is chosen first; a separate
prefill worker only when the uncached part of the prompt is long enough to be
worth a KV handoff, the request has one sample (n > 1 forks from the prompt's
KV on one worker) and a prefill worker exists — otherwise the decode worker
prefills locally (counted as a decode-only fallback when no prefill worker was up).

Like Dynamo's conditional disaggregation, remote prefill also needs room in the
prefill pool: when even the chosen prefill worker has more than
``max_prefill_queue_tokens`` waiting and the decode worker's own queue is
shorter, the decode worker prefills (an overflow). Without it a closed loop of
clients piles up behind the prefill pool while the decode pool idles. So it does
when every prefill worker is at its request limit. When every decode worker is,
``place`` raises ``AllBusy``: the request is refused here, before any worker
sees it (Dynamo's busy threshold).

The cluster KV tier (``fetch_from``): once placed, the worker that computes the prompt fetches
the blocks another worker holds beyond its own hit (any role, any tier) when moving them is
cheaper than computing them:

    move    = link_latency_s + blocks * kv_block_bytes / link_bytes_per_s
    compute = blocks * block_size / prefill_tokens_per_s

with the link's rate and the prefill rate as the workers measured them (their load reports:
the slower end of the two links), else the configured figures; with neither, nothing is moved.
A slow link recomputes, a fast one moves."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from kervan.sampling import InvalidRequest, RequestLimits
from kervan.worker_info import WorkerInfo, WorkerRole
from services.common.load import Load


@dataclass(frozen=True, kw_only=True)
class Candidate:
    worker_id: str
    address: str
    role: WorkerRole
    matched_blocks: int  # leading prompt blocks it already caches
    host_blocks: int = 0  # of those, the ones in its host tier (copied back into its pool, not computed)
    disk_blocks: int = 0  # of those, the ones only on its disk tier (read back into its pool, not computed)
    active_blocks: int  # KV blocks its running requests hold
    prefill_tokens: int = 0  # prompt tokens queued for prefill on it
    free_blocks: int = 1 << 30  # KV blocks not held by a request (cached or empty)
    evictable_blocks: int = 0  # of those, the ones still holding cached prefixes
    model: str = ""
    full: bool = False  # at its request limit: admits nothing more for now
    num_requests: int = 0  # requests it runs or queues (approx_tree's load)
    sent_blocks: int = 0  # distinct prompt blocks recently placed on it (new_prefix="content")
    limits: RequestLimits = RequestLimits(max_model_len=1 << 30, max_n=1 << 30)  # as it registered them
    prefill_tokens_per_s: float = 0.0  # as it measured them (0: not yet)
    link_bytes_per_s: float = 0.0  # what its KV transfers measured of its link (0: not yet)
    kv_block_bytes: int = 0  # one KV block, every layer and head

    @classmethod
    def reported(cls, info: WorkerInfo, load: Load) -> Candidate:
        """The worker as its own registration and load report show it (no match, nothing pending).
        Its report alone says whether it is full: adding recent placements would count twice the
        ones it already reported and refuse below its limit in a burst."""
        return cls(worker_id=info.worker_id, address=info.address, role=info.role, model=info.model,
                   matched_blocks=0, active_blocks=load.num_blocks - load.num_free_blocks,
                   prefill_tokens=load.num_prefill_tokens, free_blocks=load.num_free_blocks,
                   evictable_blocks=load.num_evictable_blocks, full=load.full, num_requests=load.num_requests,
                   limits=info.limits, prefill_tokens_per_s=load.prefill_tokens_per_s,
                   link_bytes_per_s=load.kv_link_bytes_per_s, kv_block_bytes=load.kv_block_bytes)


@dataclass(frozen=True, kw_only=True)
class Size:
    """How large a request is: what a worker's limits must hold."""

    num_prompt_tokens: int = 0
    max_tokens: int = 0
    n: int = 1

    def fits(self, c: Candidate) -> bool:
        return c.limits.allows(self.num_prompt_tokens, self.max_tokens, self.n)


@dataclass(frozen=True)
class Ask:
    """What a policy chooses for."""

    num_prompt_blocks: int
    block_hashes: Sequence[bytes] = ()  # the prompt's chained block hashes (empty where the caller has none)
    turn: int = 0  # placements made so far (round robin)


class Choice(NamedTuple):
    worker: Candidate
    scores: dict[str, float]  # worker id -> its cost, for each worker the policy priced (logs, traces)
    branch: str = ""  # which of the policy's rules chose (approx_tree: balance, cache or smallest_tree)


NEW_PREFIX = ("cost", "content")


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    policy: str = "kv"  # a name in services/scheduler/policies: "kv", the cost above; the others are baselines
    overlap_weight: float = 2.0  # Dynamo's default is 1.0; 2.0 measured better here (benchmarks/README.md)
    eviction_weight: float = 1.0  # per cached block the request would evict from the worker
    temperature: float = 0.0  # 0: argmin; > 0: softmax over -cost / temperature
    min_remote_prefill_blocks: int = 2  # shorter uncached parts are prefilled by the decode worker
    max_prefill_queue_tokens: int = 2048  # a longer prefill queue overflows to the decode worker; 0: never
    hash_prefix_blocks: int = 4  # prefix_hash: the blocks hashed
    cache_threshold: float = 0.5  # approx_tree: the match share above which the best match wins
    balance_abs_threshold: int = 32  # approx_tree: imbalance (requests) above which the idlest wins ...
    balance_rel_threshold: float = 1.0001  # ... if the busiest also runs this many times the idlest's
    # kv: where a prompt no worker caches goes. "cost": the cost above, like any request;
    # "content": the worker holding the least (its cached and in-use blocks plus the prompts
    # placed on it lately, which its reports may not show yet), as SGLang's smallest tree;
    # a temperature above 0 draws by the cost either way
    new_prefix: str = "cost"
    # a matched block in a worker's host tier, as a share of an uncached block's cost (a copy
    # back into the pool instead of a prefill: 0.1 measured as a revisit's TTFT on SmolLM2,
    # benchmarks/README.md's kv_tiers)
    host_block_cost: float = 0.1
    # a matched block only on a worker's disk tier (a read from the disk tier's file; measured
    # as a revisit's TTFT on SmolLM2 in benchmarks/README.md's kv_tiers)
    disk_block_cost: float = 0.2
    # pulling a prefix from another worker: when the chosen worker lacks prompt blocks another
    # worker holds (in any tier), that worker prefills the prompt (computing only what it lacks)
    # and pushes the whole prompt's KV over the KV transfer, if the blocks it saves outweigh
    # this share of an uncached block per block moved; 0: never (the default until measured on
    # more than one workload)
    pull_block_cost: float = 0.0
    # the cluster KV tier (``fetch_from``): fetch a prefix another worker holds when moving it is cheaper
    # than computing it, priced with what the workers measured, else these figures (0: unknown)
    kv_fetch: bool = True
    link_bytes_per_s: float = 0.0
    link_latency_s: float = 0.0005
    prefill_tokens_per_s: float = 0.0


# Why a request prefills where it does.
REMOTE = "remote"  # on a prefill worker, KV shipped to the decode worker
AGGREGATED = "aggregated"  # the chosen worker does both
SHORT = "short"  # the uncached part is too short to be worth a KV handoff
FORKED = "forked"  # n > 1: the samples fork from the prompt's KV on the decode worker
NO_PREFILL_WORKER = "no_prefill_worker"  # decode-only fallback: no prefill worker is up
PREFILL_QUEUE_FULL = "prefill_queue_full"  # overflow: the prefill pool is backed up
PULL = "pull"  # another worker holds more of the prompt: it prefills, and the KV moves


class AllBusy(Exception):
    """Every worker that could decode the request is at its request limit."""

    def __init__(self, num_workers: int):
        super().__init__(f"all {num_workers} decode or aggregated worker(s) are at their request limit")
        self.num_workers = num_workers


@dataclass(frozen=True)
class KvFetch:
    """Blocks of the prompt the worker computing it fetches from ``holder`` (the cluster KV tier)."""

    holder: Candidate
    first_block: int
    num_blocks: int
    move_s: float  # the price of moving them
    compute_s: float  # the price of computing them


@dataclass(frozen=True)
class Decision:
    decode: Candidate
    prefill: Candidate | None  # None: prefill on the decode worker
    scores: dict[str, float] = field(default_factory=dict)
    reason: str = REMOTE
    branch: str = ""  # the policy's rule that chose the decode worker (Choice.branch)
    fetch: KvFetch | None = None

    @property
    def cached_blocks(self) -> int:
        return (self.prefill or self.decode).matched_blocks


def cost(c: Candidate, num_prompt_blocks: int, cfg: PlacementConfig) -> float:
    uncached = max(0, num_prompt_blocks - c.matched_blocks)
    host = min(c.host_blocks, c.matched_blocks)  # need pool blocks too, and a copy each
    disk = min(c.disk_blocks, c.matched_blocks - host)
    copied = host + disk
    evicted = min(c.evictable_blocks, max(0, uncached + copied + 1 - (c.free_blocks - c.evictable_blocks)))
    work = uncached + cfg.host_block_cost * host + cfg.disk_block_cost * disk
    return cfg.overlap_weight * work + c.active_blocks + uncached + copied + cfg.eviction_weight * evicted


def pull_from(candidates: list[Candidate], decode: Candidate, num_prompt_blocks: int, cfg: PlacementConfig,
              size: Size) -> Candidate | None:
    """The worker to pull the prompt's prefix from (it prefills, the KV moves to ``decode``),
    or None: the one holding the most of the prompt beyond what ``decode`` holds, if the
    blocks that saves outweigh moving every prompt block at ``pull_block_cost``."""
    if cfg.pull_block_cost <= 0:
        return None
    prefill_size = Size(num_prompt_tokens=size.num_prompt_tokens, max_tokens=1)
    holders = [c for c in candidates if c.worker_id != decode.worker_id and c.role.can_prefill
               and not c.full and prefill_size.fits(c)]
    holder = max(holders, key=lambda c: c.matched_blocks, default=None)
    if holder is None:
        return None
    saved = holder.matched_blocks - decode.matched_blocks
    return holder if saved > cfg.pull_block_cost * num_prompt_blocks else None


def fetch_from(candidates: list[Candidate], computer: Candidate, cfg: PlacementConfig, block_size: int
               ) -> KvFetch | None:
    """What ``computer`` (the worker placed to compute the prompt) fetches from the worker holding
    the most of the prompt beyond its own hit, or None: no one holds more, or moving the blocks
    costs more than computing them (or either price is unknown)."""
    if not cfg.kv_fetch:
        return None
    others = [c for c in candidates if c.worker_id != computer.worker_id]
    holder = max(others, key=lambda c: c.matched_blocks, default=None)
    if holder is None or holder.matched_blocks <= computer.matched_blocks:
        return None
    num_blocks = holder.matched_blocks - computer.matched_blocks
    measured = [r for r in (holder.link_bytes_per_s, computer.link_bytes_per_s) if r > 0]
    bandwidth = min(measured) if measured else cfg.link_bytes_per_s
    rate = computer.prefill_tokens_per_s or cfg.prefill_tokens_per_s
    block_bytes = computer.kv_block_bytes or holder.kv_block_bytes
    if bandwidth <= 0 or rate <= 0 or block_bytes <= 0:
        return None
    move_s = cfg.link_latency_s + num_blocks * block_bytes / bandwidth
    compute_s = num_blocks * block_size / rate
    if move_s >= compute_s:
        return None
    return KvFetch(holder, computer.matched_blocks, num_blocks, move_s, compute_s)


def has_room(c: Candidate, num_prompt_blocks: int) -> bool:
    # the uncached blocks, those copied back from host memory or disk, and one to decode into
    return c.free_blocks > num_prompt_blocks - c.matched_blocks + min(c.host_blocks + c.disk_blocks, c.matched_blocks)


class Policy(Protocol):
    """What placement needs of a policy: ``policies/base.py``'s ``PlacementPolicy`` is one (the
    policies import this module's records, so this module names only the shape)."""

    @property
    def config(self) -> PlacementConfig: ...

    @property
    def needs_room(self) -> bool: ...

    def choose(self, pool: list[Candidate], ask: Ask) -> Choice: ...


def choose(pool: list[Candidate], ask: Ask, policy: Policy) -> Choice:
    if policy.needs_room:
        pool = [c for c in pool if has_room(c, ask.num_prompt_blocks)] or pool
    return policy.choose(pool, ask)


def place(candidates: list[Candidate], num_prompt_blocks: int, policy: Policy, *, model: str = "",
          size: Size = Size(), block_hashes: Sequence[bytes] = (), turn: int = 0, block_size: int = 16
          ) -> Decision | None:
    """``model``: only workers serving it (empty: any); ``block_hashes``: the prompt's, for
    the policies that hash them; ``turn``: a counter the caller advances per request (round
    robin). A request the decode worker would prefill itself is prefilled where its prefix
    is instead when that pays (``pull_from``); otherwise the worker that prefills fetches
    what another holds of the prompt when that pays (``fetch_from``)."""
    candidates = [c for c in candidates if not model or c.model == model]
    ask = Ask(num_prompt_blocks, block_hashes, turn)
    decision = _place(candidates, ask, policy, size)
    if decision is None:
        return None
    if decision.prefill is None and size.n == 1:
        holder = pull_from(candidates, decision.decode, num_prompt_blocks, policy.config, size)
        if holder is not None:
            return Decision(decision.decode, holder, decision.scores, PULL, decision.branch)
    fetch = fetch_from(candidates, decision.prefill or decision.decode, policy.config, block_size)
    return decision if fetch is None else dataclasses.replace(decision, fetch=fetch)


def _place(candidates: list[Candidate], ask: Ask, policy: Policy, size: Size) -> Decision | None:
    cfg = policy.config
    decoders = [c for c in candidates if c.role.can_decode]
    if not decoders:
        return None
    fitting = [c for c in decoders if size.fits(c)]
    if not fitting:
        largest = RequestLimits(max_model_len=max(c.limits.max_model_len for c in decoders),
                                max_n=max(c.limits.max_n for c in decoders))
        largest.check(size.num_prompt_tokens, size.max_tokens, size.n)  # names the limit it exceeds
        raise InvalidRequest(f"no worker serves both n={size.n} and prompt ({size.num_prompt_tokens} tokens) + "
                             f"max_tokens ({size.max_tokens}) at once")  # each alone fits some worker
    if all(c.full for c in fitting):
        raise AllBusy(len(fitting))
    decode, scores, branch = choose([c for c in fitting if not c.full], ask, policy)
    uncached = ask.num_prompt_blocks - decode.matched_blocks
    if decode.role is WorkerRole.BOTH:
        return Decision(decode, None, scores, AGGREGATED, branch)
    if size.n > 1:
        return Decision(decode, None, scores, FORKED, branch)
    if uncached < cfg.min_remote_prefill_blocks:
        return Decision(decode, None, scores, SHORT, branch)
    prefill_size = Size(num_prompt_tokens=size.num_prompt_tokens, max_tokens=1)  # it computes the first token
    prefillers = [c for c in candidates if c.role is WorkerRole.PREFILL and prefill_size.fits(c)]
    if not prefillers:
        return Decision(decode, None, scores, NO_PREFILL_WORKER, branch)
    prefillers = [c for c in prefillers if not c.full]
    if not prefillers:
        return Decision(decode, None, scores, PREFILL_QUEUE_FULL, branch)
    prefill, prefill_scores, _ = choose(prefillers, ask, policy)
    scores = {**scores, **prefill_scores}
    if 0 < cfg.max_prefill_queue_tokens < prefill.prefill_tokens and decode.prefill_tokens < prefill.prefill_tokens:
        return Decision(decode, None, scores, PREFILL_QUEUE_FULL, branch)
    return Decision(decode, prefill, scores, REMOTE, branch)
