"""The engine's iteration scheduler: which sequences run this step, and how many
of their tokens.

There are no prefill and decode phases. Every sequence has ``num_tokens`` (prompt
plus outputs) and ``num_computed_tokens`` (those with KV in the cache), and each
step moves the second towards the first under one token budget. That one rule
gives continuous batching, chunked prefill (a long prompt takes several steps)
and prefix reuse (cached blocks start ``num_computed_tokens`` ahead).

A running sequence with speculative guesses (``Sequence.draft_tokens``) runs them after
its next token as a small chunk, inside the same budget; the step verifies them and the
slots of the rejected ones are freed. Guesses are cut to the budget left, and never
preempt anyone: when blocks run out a sequence runs without them.

Running sequences go first, in arrival order; when blocks run out the latest
arrival is preempted (its blocks freed: the full ones stay cached, and with a host
tier they are demoted when reused, so the sequence resumes by copying them back;
only what no tier kept is recomputed). Waiting sequences are
admitted while budget, sequence slots and blocks last; none is admitted in a step
that had to preempt. (Not to be confused with the mesh-level placement in
``services/scheduler/``, which chooses a worker.)"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from worker.config import EngineConfig
from worker.engine.sequence import Sequence, SequenceStatus
from worker.kv.kv_cache_manager import BlockCopy, KVCacheManager


@dataclass
class ScheduledSequence:
    sequence: Sequence
    num_computed: int  # tokens with KV before this step
    num_new_tokens: int
    block_ids: list[int]
    num_samples: int  # 0: a prompt chunk that does not reach the end; n: first sample of an n > 1 request
    # speculative guesses run after the sequence's next token (counted in num_new_tokens), verified this step
    guesses: list[int] = field(default_factory=list)


@dataclass
class KVWrite:
    """Imported KV to place into blocks before this step's forward."""

    block_ids: list[int]
    data: torch.Tensor  # [layers, 2, len(block_ids), kv_heads, block_size * head_dim]


@dataclass
class ScheduledBatch:
    sequences: list[ScheduledSequence]
    block_copies: list[BlockCopy]
    kv_writes: list[KVWrite] = field(default_factory=list)


class StepScheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[str, Sequence] = {}  # finished, blocks kept for a KV handoff
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:  # held requests are finished: they only pin blocks
        return len(self.waiting) + len(self.running)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens admitted but not yet computed: this engine's prefill queue
        (imported prompts only need their KV copied in: they do not count)."""
        return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens)
                   for q in (self.waiting, self.running) for r in q if r.imported_kv is None)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            guesses = req.draft_tokens[:budget - 1] if n == 1 else []
            if guesses and self.kv.allocate_slots(req, n + len(guesses)) is None:
                guesses = []  # guesses never preempt anyone
            while not guesses and self.kv.allocate_slots(req, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append(self._scheduled(req, req.num_computed_tokens, n, guesses))
                budget -= n + len(guesses)
                i += 1
        writes: list[KVWrite] = []
        taken = sum(_seats(r) for r in self.running)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            req = self.waiting[0]
            if taken + _seats(req) > self.config.max_num_seqs:
                break
            hit = self.kv.get_computed_blocks(req)
            cached = hit.num_tokens
            if req.imported_kv is not None:
                # the prompt's KV arrived with the request: place it, compute only the next token
                if self.kv.allocate_slots(req, req.num_tokens - hit.num_tokens, hit.blocks) is None:
                    break
                first = len(hit.blocks)
                blocks = self.kv.get_block_ids(req.seq_id)[first:req.imported_kv.shape[2]]
                writes.append(KVWrite(blocks, req.imported_kv[:, :, first:]))
                req.imported_kv = None
                start = req.num_prompt_tokens
            else:
                # what the pool lacks but the host tier holds is copied back, not computed (no budget);
                # what only the disk tier holds is read first, while others run
                tiers = self.kv.tiers
                if tiers is not None and tiers.awaiting_disk(req, len(hit.blocks)):
                    break
                promoted = tiers.prefix(req, len(hit.blocks)) if tiers is not None else []
                start = cached = hit.num_tokens + len(promoted) * self.config.block_size
                if self.kv.allocate_slots(req, start - hit.num_tokens + min(req.num_tokens - start, budget),
                                          hit.blocks) is None:
                    break
                if promoted:
                    first = len(hit.blocks)
                    blocks = self.kv.get_block_ids(req.seq_id)[first:first + len(promoted)]
                    for part in tiers.take(req, promoted):  # runs of the tiers' slots, copied in place
                        writes.append(KVWrite(blocks[:part.shape[2]], part))
                        blocks = blocks[part.shape[2]:]
            n = min(req.num_tokens - start, budget)
            self.waiting.popleft()
            req.status = SequenceStatus.RUNNING
            if req.queue_time_s is None:  # a preempted sequence's second admission does not count
                req.queue_time_s = time.monotonic() - req.arrival_time
            req.num_computed_tokens = start
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = cached
                if self.kv.tiers is not None:
                    self.kv.tiers.count_use(req)
            self.running.append(req)
            taken += _seats(req)
            scheduled.append(self._scheduled(req, start, n))
            budget -= n
        return ScheduledBatch(scheduled, self.kv.take_copies(), writes)

    def _scheduled(self, req: Sequence, num_computed: int, n: int, guesses: list[int] = ()) -> ScheduledSequence:
        reaches_end = num_computed + n == req.num_tokens
        first_of_many = req.num_output_tokens == 0 and req.params.n > 1 and req.sample_index == 0
        samples = (req.params.n if first_of_many else 1) if reaches_end else 0
        return ScheduledSequence(req, num_computed, n + len(guesses), self.kv.get_block_ids(req.seq_id), samples,
                                 list(guesses))

    def _preempt(self, req: Sequence) -> None:
        if self.kv.tiers is not None:
            self.kv.tiers.count_use(req, resumes=True)  # its blocks pass the tiers' reuse gate
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def update(self, batch: ScheduledBatch, samples: dict[str, list[list[tuple[int, float | None]]]]
               ) -> list[Sequence]:
        """Apply a step's results: per sequence, one run of (token, logprob) per sample drawn
        (a run longer than one token: guesses accepted, then the target's own token). Returns
        the sequences that gained tokens (forked samples included). Finished sequences leave
        the running set and free their blocks."""
        progressed = []
        for seq in batch.sequences:
            req = seq.sequence
            req.draft_tokens, req.draft_probs = [], None  # this step verified them
            computed = seq.num_computed + seq.num_new_tokens - len(seq.guesses)
            req.num_computed_tokens = computed
            if seq.num_samples == 0:
                continue
            drawn = samples[req.seq_id]
            for k in range(1, seq.num_samples):
                child = req.fork(k)
                self.kv.fork(req, child)
                self.running.append(child)
                self._append(child, drawn[k])
                progressed.append(child)
            # the guesses accepted (each but the run's last token) had their KV computed this step
            req.num_computed_tokens = computed + self._append(req, drawn[0]) - 1
            if seq.guesses and not req.is_finished:
                self.kv.trim(req, req.num_tokens)
            progressed.append(req)
        if any(r.is_finished for r in progressed):
            self.running = [r for r in self.running if not r.is_finished]
        return progressed

    def _append(self, req: Sequence, run: list[tuple[int, float | None]]) -> int:
        """Append a run of tokens up to the first that finishes the sequence; how many were."""
        appended = 0
        for token, logprob in run:
            appended += 1
            req.append_output(token, logprob)
            if token in req.stop_ids:
                req.status = SequenceStatus.FINISHED_STOPPED
            elif req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= self.config.max_model_len:
                req.status = SequenceStatus.FINISHED_LENGTH
            if req.is_finished:
                break
        if req.is_finished:
            if req.hold_kv:
                self.held[req.seq_id] = req
            else:
                self.kv.free(req)
        return appended

    def release(self, request_id: str) -> bool:
        """Free the blocks of a finished request held for a KV handoff."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.kv.free(req)
        return req is not None

    def abort(self, seqs: list[Sequence]) -> None:
        for req in seqs:
            if req.is_finished:
                continue
            req.status = SequenceStatus.FINISHED_ABORTED
            self.kv.free(req)
        self.waiting = deque(r for r in self.waiting if not r.is_finished)
        self.running = [r for r in self.running if not r.is_finished]


def _seats(req: Sequence) -> int:
    """Running sequences a request will take: one of n samples not yet forked takes n
    (its forks join the running set once its prompt is done)."""
    return req.params.n if req.sample_index == 0 and req.num_output_tokens == 0 else 1
