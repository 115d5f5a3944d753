# mypy: disable-error-code="arg-type,type-var,union-attr"
"""The ``draft`` method: a smaller model with the target's tokenizer guesses the next
tokens, k steps of its own per target step.

The draft keeps a shadow of each sequence: its tokens and how many of them have KV in
the draft's own paged cache. Before guessing, a shadow catches up with the target (the
tokens the target kept since, as one chunk; its KV past the first token the two disagree
on is stale and is recomputed), then the draft decodes k tokens. All sequences run
together in each of those k passes.

A greedy or seeded request gets point guesses (the draft's argmax): verified against the
target's own draws, they keep a seed's tokens exactly as without speculation. Any other
sampled request gets guesses drawn from the draft's distribution under the request's
temperature, top-k, top-p and min-p, verified by rejection sampling (``verify.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kervan.tokenizer import Tokenizer
from worker.batch import ScheduledSequence
from worker.config import ConfigError, EngineConfig, ModelConfig
from worker.kv.kv_cache_manager import KVCacheManager
from worker.loader import load_model
from worker.models.decoder import DecoderModel
from worker.runner.model_runner import ModelRunner, is_chunk
from worker.sequence import Sequence
from worker.spec.proposer import decoding, draw_guesses, forget_finished, guess_limit, register_proposer


@dataclass
class Shadow:
    """What the draft's cache manager and runner read of a sequence (no block hashes: the
    draft caches no prefixes)."""

    seq_id: str
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_hashes: list = field(default_factory=list)
    num_synced: int = 0  # the target's tokens as of the last guess (the rest of token_ids: guesses)


class DraftProposer:
    reads_hidden = False

    def __init__(self, model_dir: str | Path, config: EngineConfig, target: ModelConfig, target_dir: str | Path):
        draft = ModelConfig.from_dir(model_dir)
        _check_same_tokenizer(model_dir, draft, target_dir, target)
        self.k = config.num_speculative_tokens
        self.max_model_len = min(config.max_model_len, draft.max_position)
        # the draft's cache has as many blocks as the target's (each far smaller), no prefix caching
        self.config = replace(config, speculative=None, speculative_model=None, enable_prefix_caching=False,
                              deterministic=False, quantization=None, max_model_len=self.max_model_len)
        model = load_model(model_dir, self.config.dtype, self.max_model_len, self.config.device)
        self.runner = ModelRunner(model, self.config)
        self.kv = KVCacheManager(self.config.num_kv_blocks, self.config.block_size, enable_caching=False)
        self.shadows: dict[str, Shadow] = {}

    def propose(self, running: list[Sequence]) -> None:
        forget_finished(self.shadows, self.kv, running)
        plans: list[tuple[Sequence, Shadow, int]] = []
        for seq in decoding(running):
            seq.draft_tokens, seq.draft_probs = [], None
            limit = guess_limit(seq, self.k, self.max_model_len)
            shadow = self._sync(seq) if limit else None
            # KV for every guess but the last, allocated for all k passes at once
            if shadow is not None and self.kv.allocate_slots(
                    shadow, len(shadow.token_ids) - shadow.num_computed_tokens + limit - 1) is not None:
                plans.append((seq, shadow, limit))
        probs: dict[str, list[torch.Tensor]] = {}
        for round_ in range(self.k):
            batch = [(seq, shadow) for seq, shadow, limit in plans if limit > round_]
            if not batch:
                break
            scheduled = [ScheduledSequence(shadow, shadow.num_computed_tokens,
                                           len(shadow.token_ids) - shadow.num_computed_tokens,
                                           self.kv.get_block_ids(shadow.seq_id), 1) for _, shadow in batch]
            order = sorted(range(len(batch)), key=lambda i: is_chunk(scheduled[i]))  # decodes first
            batch, scheduled = [batch[i] for i in order], [scheduled[i] for i in order]
            logits = self.runner.forward(self.runner.prepare(scheduled, self.kv.take_copies())).cpu()
            guesses = draw_guesses(self.runner.sampler, logits, [seq for seq, _ in batch], probs)
            for (seq, shadow), guess in zip(batch, guesses):
                shadow.num_computed_tokens = len(shadow.token_ids)
                shadow.token_ids.append(guess)
                seq.draft_tokens.append(guess)
        for seq, _, _ in plans:
            if seq.seq_id in probs:
                seq.draft_probs = torch.stack(probs[seq.seq_id])

    def _sync(self, seq: Sequence) -> Shadow:
        """The sequence's shadow, caught up with the target's tokens: KV is kept up to the
        first token where the guesses of last time and the tokens kept differ."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self.shadows[seq.seq_id] = Shadow(seq.seq_id, [])
        old, new = shadow.token_ids, seq.token_ids
        same, end = shadow.num_synced, min(len(old), len(new))
        while same < end and old[same] == new[same]:
            same += 1
        shadow.token_ids = list(seq.token_ids)
        shadow.num_synced = len(seq.token_ids)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, same, len(seq.token_ids) - 1)
        self.kv.trim(shadow, shadow.num_computed_tokens)
        return shadow

    def observe(self, scheduled: list[ScheduledSequence], hidden: dict[str, torch.Tensor]) -> None:
        pass

    def close(self) -> None:
        for shadow in self.shadows.values():
            self.kv.free(shadow)
        self.shadows.clear()


def _check_same_tokenizer(draft_dir: str | Path, draft: ModelConfig, target_dir: str | Path,
                          target: ModelConfig) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"the draft model's vocabulary has {draft.vocab_size} tokens and the target's "
                          f"{target.vocab_size}: a draft needs the target's tokenizer")
    mine, theirs = Tokenizer.from_dir(draft_dir), Tokenizer.from_dir(target_dir)
    if (mine is None) != (theirs is None) or (mine is not None and mine.vocabulary() != theirs.vocabulary()):
        raise ConfigError(f"the draft model in {draft_dir} has another tokenizer than the target: "
                          f"a draft needs the target's tokenizer")


@register_proposer("draft")
def _draft(config: EngineConfig, target: DecoderModel, target_dir: Path) -> DraftProposer:
    return DraftProposer(config.speculative_model, config, target.cfg, target_dir)
