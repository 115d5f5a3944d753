"""Proposers: after each step, guesses of the next tokens of the sequences that decode,
for the next step to verify (``Sequence.draft_tokens``; ``draft_probs`` when a draft
sampled them from its own distributions).

A proposer never guesses past what a sequence may still emit: one token less than its
``max_tokens`` left (the step's own token comes after the guesses) and no position past
``max_model_len``.

Each proposer's file registers a factory under its name (``register_proposer``, the names
``kervan.speculative.SPECULATIVE_METHODS`` lists for the command line), and ``make_proposer``
imports every module of ``worker.spec`` before it looks one up: a new proposer is a new file."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from worker.batch import ScheduledSequence
from worker.config import ConfigError, EngineConfig
from worker.models.decoder import DecoderModel
from worker.runner.sampler import Sampler, SamplingRow, argmax
from worker.sequence import Sequence
from worker.spec.ngram import NgramProposer
from worker.spec.verify import normalized


class Proposer(Protocol):
    reads_hidden: bool  # observe() wants the target's hidden states (``ModelRunner.keep_hidden``)

    def propose(self, running: list[Sequence]) -> None:
        """Set the guesses of the running sequences that decode next (``decoding``)."""

    def observe(self, scheduled: list[ScheduledSequence], hidden: dict[str, torch.Tensor]) -> None:
        """After each step: the target's final hidden states of the rows it kept (proposers
        that read them ask ``ModelRunner.keep_hidden``)."""

    def close(self) -> None:
        """Free what the proposer holds."""


def draw_guesses(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], probs: dict[str, list[torch.Tensor]],
                 vocab: torch.Tensor | None = None, vocab_size: int = 0) -> list[int]:
    """Each sequence's next guess from a draft's logits: the argmax for greedy and seeded
    requests (point guesses), else a draw from the draft's distribution under the request's
    temperature, top-k, top-p and min-p, which is appended to ``probs`` (rejection sampling
    needs it). ``vocab``: the target's id of each of the draft's columns (a draft vocabulary
    smaller than the target's ``vocab_size``)."""
    picked = argmax(logits)
    sampled = [i for i, seq in enumerate(seqs) if not seq.params.is_greedy and seq.generator is None]
    if sampled:
        rows = [SamplingRow(seqs[i].params, None) for i in sampled]
        q = normalized(sampler.probs(logits[sampled].float(), rows))
        picked[sampled] = (q / sampler.noise(q.shape, rows)).argmax(dim=-1)
        if vocab is not None:
            q = torch.zeros(len(sampled), vocab_size).index_copy_(1, vocab, q)
        for i, row_q in zip(sampled, q):
            probs.setdefault(seqs[i].seq_id, []).append(row_q)
    return (picked if vocab is None else vocab[picked]).tolist()


def decoding(running: list[Sequence]) -> list[Sequence]:
    """The sequences whose next step computes one token of their own, which guesses may follow."""
    return [seq for seq in running if seq.num_tokens - seq.num_computed_tokens == 1]


def forget_finished(shadows: dict, kv, running: list[Sequence]) -> None:
    """Free the shadows (and their blocks in ``kv``) of sequences no longer running: finished,
    aborted or preempted (a preempted one starts a new shadow when it runs again)."""
    live = {seq.seq_id for seq in running}
    for seq_id in [s for s in shadows if s not in live]:
        kv.free(shadows.pop(seq_id))


def guess_limit(seq: Sequence, num_speculative_tokens: int, max_model_len: int) -> int:
    """How many guesses are worth verifying for ``seq`` now."""
    left = seq.params.max_tokens - seq.num_output_tokens - 1
    return max(0, min(num_speculative_tokens, left, max_model_len - seq.num_tokens))


class PromptLookup:
    """The ``ngram`` method: guesses copied from the tokens so far (``ngram.py``)."""

    reads_hidden = False

    def __init__(self, config: EngineConfig):
        self.ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        if config.max_model_len is None:
            raise ValueError("a proposer takes a resolved config (EngineConfig.resolve)")
        self.max_model_len = config.max_model_len

    def propose(self, running: list[Sequence]) -> None:
        for seq in decoding(running):
            limit = guess_limit(seq, self.ngram.num_speculative_tokens, self.max_model_len)
            seq.draft_tokens = self.ngram.propose(seq.token_ids)[:limit] if limit else []
            seq.draft_probs = None

    def observe(self, scheduled: list[ScheduledSequence], hidden: dict[str, torch.Tensor]) -> None:
        pass

    def close(self) -> None:
        pass


ProposerFactory = Callable[[EngineConfig, DecoderModel, Path], Proposer]
PROPOSERS: dict[str, tuple[ProposerFactory, bool]] = {}  # name -> (factory, whether a worker group may run it)


def register_proposer(name: str, *, in_groups: bool = False) -> Callable[[ProposerFactory], ProposerFactory]:
    """Offer a proposer factory as ``speculative=name``; ``in_groups``: it runs beside a worker
    group's ranks too (a proposer with a model of its own runs in one process for now)."""
    def add(factory: ProposerFactory) -> ProposerFactory:
        if name in PROPOSERS and PROPOSERS[name][0] is not factory:
            raise ValueError(f"two proposers are named {name!r}")
        PROPOSERS[name] = (factory, in_groups)
        return factory
    return add


def proposer_names() -> list[str]:
    import worker.spec as package

    for module in pkgutil.iter_modules(package.__path__):  # each proposer's file registers itself
        importlib.import_module(f"{package.__name__}.{module.name}")
    return sorted(PROPOSERS)


def make_proposer(config: EngineConfig, target: DecoderModel, target_dir: str | Path) -> Proposer | None:
    if config.speculative is None:
        return None
    if config.speculative not in proposer_names():
        raise ConfigError(f"speculative={config.speculative!r} is not a proposer; known: {', '.join(PROPOSERS)}")
    factory, in_groups = PROPOSERS[config.speculative]
    if config.world_size > 1 and not in_groups:
        raise ConfigError(f"speculative={config.speculative!r} runs its model beside the target in one process; "
                          f"with a worker group use speculative='ngram' for now")
    return factory(config, target, Path(target_dir))


@register_proposer("ngram", in_groups=True)
def _prompt_lookup(config: EngineConfig, target: DecoderModel, target_dir: Path) -> Proposer:
    return PromptLookup(config)
