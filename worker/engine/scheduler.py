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

Running sequences go first, in the order they were admitted. That already puts a
stream's next token before any prompt admitted after it, and a prompt admitted
before it can only take less of the budget as it goes (its chunk is what is left of
it, or the cap), so an admitted stream is never starved by a prompt (speculative
guesses aside: an earlier stream may take fewer of them than when this one came in, and
leave the prompt more): decodes come first in effect, as in Sarathi-Serve. What a long
prompt does delay is new arrivals, left waiting while its chunks take the whole budget; ``long_prefill_token_threshold``
caps a prompt's chunk per step so that they are admitted beside it. When blocks run
out the latest arrival is preempted (its blocks freed: the full ones stay cached, and with a host
tier they are demoted when reused, so the sequence resumes by copying them back;
only what no tier kept is recomputed). Waiting sequences are
admitted while budget, sequence slots and blocks last; none is admitted in a step
that had to preempt. (Not to be confused with the mesh-level placement in
``services/scheduler/``, which chooses a worker.)"""

from __future__ import annotations

import time
from collections import deque

from worker.batch import KVWrite, ScheduledBatch, ScheduledSequence
from worker.config import EngineConfig
from worker.kv.kv_cache_manager import KVCacheManager, Prefix
from worker.sequence import Sequence, SequenceStatus


class StepScheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        if config.max_model_len is None:
            raise ValueError("the scheduler takes a resolved config (EngineConfig.resolve)")
        self.config = config
        self.max_model_len = config.max_model_len
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
        scheduled, budget, preempted = self._schedule_running(budget)
        writes: list[KVWrite] = []
        taken = sum(_seats(r) for r in self.running)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if taken + _seats(seq) > self.config.max_num_seqs:
                break
            prefix = self.kv.prefix(seq)  # the pool's cache, the tiers', or the request's own KV
            if prefix is None:  # its disk blocks are being read: the others run meanwhile
                break
            n = self._chunk(seq, prefix.num_tokens, budget)
            placed = self.kv.place(seq, prefix, n)
            if placed is None:
                break
            writes += placed
            self._admit(seq, prefix)
            taken += _seats(seq)
            scheduled.append(self._scheduled(seq, prefix.num_tokens, n))
            budget -= n
        return ScheduledBatch(scheduled, self.kv.take_copies(), writes)

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledSequence], int, bool]:
        """The running sequences' next tokens (and guesses), in admission order; preempts the
        latest arrivals when blocks run out. Returns them, the budget left, and whether any
        sequence was preempted."""
        scheduled: list[ScheduledSequence] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, seq.num_computed_tokens, budget)
            guesses = seq.draft_tokens[:budget - 1] if n == 1 else []
            if guesses and self.kv.allocate_slots(seq, n + len(guesses)) is None:
                guesses = []  # guesses never preempt anyone
            while not guesses and self.kv.allocate_slots(seq, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append(self._scheduled(seq, seq.num_computed_tokens, n, guesses))
                budget -= n + len(guesses)
                i += 1
        return scheduled, budget, preempted

    def _admit(self, seq: Sequence, prefix: Prefix) -> None:
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        if seq.queue_time_s is None:  # a preempted sequence's second admission does not count
            seq.queue_time_s = time.monotonic() - seq.arrival_time
        seq.num_computed_tokens = prefix.num_tokens
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = prefix.num_reused_tokens
            if self.kv.tiers is not None:
                self.kv.tiers.count_use(seq)
        self.running.append(seq)

    def _chunk(self, seq: Sequence, num_computed: int, budget: int) -> int:
        """How many of the sequence's tokens this step computes: what is left, within the
        budget and, for a prompt, within ``long_prefill_token_threshold`` (0: no cap)."""
        n = min(seq.num_tokens - num_computed, budget)
        cap = self.config.long_prefill_token_threshold
        return min(n, cap) if cap > 0 else n

    def _scheduled(self, seq: Sequence, num_computed: int, n: int,
                   guesses: list[int] | tuple[()] = ()) -> ScheduledSequence:
        reaches_end = num_computed + n == seq.num_tokens
        first_of_many = seq.num_output_tokens == 0 and seq.params.n > 1 and seq.sample_index == 0
        samples = (seq.params.n if first_of_many else 1) if reaches_end else 0
        return ScheduledSequence(seq, num_computed, n + len(guesses), self.kv.get_block_ids(seq.seq_id), samples,
                                 list(guesses))

    def _preempt(self, seq: Sequence) -> None:
        if self.kv.tiers is not None:
            self.kv.tiers.count_use(seq, resumes=True)  # its blocks pass the tiers' reuse gate
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, batch: ScheduledBatch, samples: dict[str, list[list[tuple[int, float | None]]]]
               ) -> list[Sequence]:
        """Apply a step's results: per sequence, one run of (token, logprob) per sample drawn
        (a run longer than one token: guesses accepted, then the target's own token). Returns
        the sequences that gained tokens (forked samples included). Finished sequences leave
        the running set and free their blocks."""
        progressed = []
        for scheduled in batch.sequences:
            seq = scheduled.sequence
            seq.draft_tokens, seq.draft_probs = [], None  # this step verified them
            computed = scheduled.num_computed + scheduled.num_new_tokens - len(scheduled.guesses)
            seq.num_computed_tokens = computed
            if scheduled.num_samples == 0:
                continue
            drawn = samples[seq.seq_id]
            for k in range(1, scheduled.num_samples):
                child = seq.fork(k)
                self.kv.fork(seq, child)
                self.running.append(child)
                self._append(child, drawn[k])
                progressed.append(child)
            # the guesses accepted (each but the run's last token) had their KV computed this step
            seq.num_computed_tokens = computed + self._append(seq, drawn[0]) - 1
            if scheduled.guesses and not seq.is_finished:
                self.kv.trim(seq, seq.num_tokens)
            progressed.append(seq)
        if any(r.is_finished for r in progressed):
            self.running = [r for r in self.running if not r.is_finished]
        return progressed

    def _append(self, seq: Sequence, run: list[tuple[int, float | None]]) -> int:
        """Append a run of tokens up to the first that finishes the sequence; how many were."""
        appended = 0
        for token, logprob in run:
            appended += 1
            seq.append_output(token, logprob)
            if token in seq.stop_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
            elif seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.status = SequenceStatus.FINISHED_LENGTH
            if seq.is_finished:
                break
        if seq.is_finished:
            if seq.hold_kv:
                self.held[seq.seq_id] = seq
            else:
                self.kv.free(seq)
        return appended

    def release(self, request_id: str) -> bool:
        """Free the blocks of a finished request held for a KV handoff."""
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)
        return seq is not None

    def abort(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.is_finished:
                continue
            seq.status = SequenceStatus.FINISHED_ABORTED
            self.kv.free(seq)
        self.waiting = deque(r for r in self.waiting if not r.is_finished)
        self.running = [r for r in self.running if not r.is_finished]


def _seats(seq: Sequence) -> int:
    """Running sequences a request will take: one of n samples not yet forked takes n
    (its forks join the running set once its prompt is done)."""
    return seq.params.n if seq.sample_index == 0 and seq.num_output_tokens == 0 else 1
