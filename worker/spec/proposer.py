"""Proposers: after each step, guesses of the next tokens of the sequences that decode,
for the next step to verify (``Sequence.draft_tokens``; ``draft_probs`` when a draft
sampled them from its own distributions).

A proposer never guesses past what a sequence may still emit: one token less than its
``max_tokens`` left (the step's own token comes after the guesses) and no position past
``max_model_len``."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from worker.config import ConfigError, EngineConfig, ModelConfig
from worker.engine.sequence import Sequence
from worker.spec.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence]) -> None:
        """Set the guesses of each of ``seqs`` (running, each with its next token to compute)."""

    def close(self) -> None:
        """Free what the proposer holds."""


def guess_limit(seq: Sequence, num_speculative_tokens: int, max_model_len: int) -> int:
    """How many guesses are worth verifying for ``seq`` now."""
    left = seq.params.max_tokens - seq.num_output_tokens - 1
    return max(0, min(num_speculative_tokens, left, max_model_len - seq.num_tokens))


class PromptLookup:
    """The ``ngram`` method: guesses copied from the tokens so far (``ngram.py``)."""

    def __init__(self, config: EngineConfig):
        self.ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        self.max_model_len = config.max_model_len

    def propose(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            limit = guess_limit(seq, self.ngram.num_speculative_tokens, self.max_model_len)
            seq.draft_tokens = self.ngram.propose(seq.token_ids)[:limit] if limit else []
            seq.draft_probs = None

    def close(self) -> None:
        pass


def make_proposer(config: EngineConfig, target: ModelConfig, target_dir: str | Path) -> Proposer | None:
    if config.speculative is None:
        return None
    if config.speculative == "ngram":
        return PromptLookup(config)
    if config.world_size > 1:
        raise ConfigError("a draft model runs beside rank 0 of one process; with a worker group use "
                          "speculative='ngram' for now")
    from worker.spec.draft import DraftProposer

    return DraftProposer(config.speculative_model, config, target, target_dir)
