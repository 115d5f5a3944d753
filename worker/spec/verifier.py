# mypy: disable-error-code="arg-type,assignment,index,misc,return-value"
"""The runner's side of speculative decoding: the sampling rows of a sequence that runs
guesses, and the run of tokens it keeps (``verify.py`` holds the rules), counted as vLLM
counts them (drafts, draft tokens, accepted tokens, accepted per position)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.batch import ScheduledSequence
from worker.noise import exponential
from worker.runner.sampler import Sampler, SamplingRow
from worker.spec.verify import accept_matching, normalized, rejection_sample

Token = tuple[int, float | None]


@dataclass
class SpecCounters:
    """Since the engine started: sequences that ran guesses (one draft each per step), their
    guesses, the guesses kept, and how many were kept at each position (a guess at
    position i is kept only when every guess before it was)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def count(self, num_guesses: int, num_kept: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_guesses
        self.num_accepted_tokens += num_kept
        if len(self.accepted_per_position) < num_guesses:
            self.accepted_per_position += [0] * (num_guesses - len(self.accepted_per_position))
        for i in range(num_kept):
            self.accepted_per_position[i] += 1


class Verifier:
    def __init__(self, sampler: Sampler, vocab_size: int):
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.counters = SpecCounters()

    def rows(self, seq: ScheduledSequence) -> list[SamplingRow]:
        """The rows a scheduled sequence samples: one per sample, or with guesses one per
        guess and one after them. A seeded sample takes its noise from the sequence, which
        keeps what a step drew and did not use for the positions after it."""
        s = seq.sequence
        count = len(seq.guesses) + 1 if seq.guesses else seq.num_samples
        if seq.num_samples == 1 and s.generator is not None and not s.params.is_greedy and (
                seq.guesses or s.pending_noise):
            return [SamplingRow(s.params, None, noise) for noise in s.take_noise(count, self.vocab_size)]
        if seq.guesses:
            return [SamplingRow(s.params, s.generator)] * count
        return [SamplingRow(s.params, s.sample_generators[s.sample_index + k]) for k in range(count)]

    @staticmethod
    def rejection_samples(seq: ScheduledSequence) -> bool:
        """The sequence's guesses came with the draft's distributions and are verified by
        rejection sampling, which draws its own tokens (the sampler's would go unused)."""
        s = seq.sequence
        return bool(seq.guesses) and s.draft_probs is not None and not s.params.is_greedy

    def run(self, seq: ScheduledSequence, logits: torch.Tensor, rows: list[SamplingRow], tokens: list[int],
            logprobs: list[float] | None) -> list[Token]:
        """The tokens a sequence keeps from a step that verified its guesses: the guesses
        kept, then the target's next token. ``logits`` [guesses + 1, vocab] are the
        target's rows, ``tokens`` what the sampler drew from them."""
        s = seq.sequence
        guesses = torch.tensor(seq.guesses)[None]
        if not self.rejection_samples(seq):
            kept, _ = accept_matching(torch.tensor(tokens)[None], guesses)
            kept = int(kept)
            if rows[0].noise is not None:
                s.keep_noise([row.noise for row in rows[kept + 1:]])
            emitted = tokens[:kept + 1]
        else:
            kept, emitted = self._rejection_sample(seq, logits, rows)
            if s.params.logprobs:  # the sampler took these rows' argmax and left their logprobs
                logprobs = torch.log_softmax(logits.float(), dim=-1).gather(
                    1, torch.tensor(emitted)[:, None]).squeeze(1).tolist()
        self.counters.count(len(seq.guesses), kept)
        return [(t, None if logprobs is None else logprobs[j]) for j, t in enumerate(emitted)]

    def _rejection_sample(self, seq: ScheduledSequence, logits: torch.Tensor,
                          rows: list[SamplingRow]) -> tuple[int, list[int]]:
        num_guesses = len(seq.guesses)
        p = normalized(self.sampler.probs(logits.float(), rows))
        q = seq.sequence.draft_probs[:num_guesses]
        generator = self.sampler.generator
        uniforms = torch.rand(1, num_guesses, generator=generator)
        kept, after = rejection_sample(p[None], q[None], torch.tensor(seq.guesses)[None], uniforms,
                                       lambda kept: exponential((1, self.vocab_size), generator))
        kept = int(kept)
        return kept, seq.guesses[:kept] + [int(after)]
