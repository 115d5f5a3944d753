# mypy: disable-error-code="arg-type,index,union-attr"
"""The ``eagle`` method: an EAGLE head (``eagle_head.py``) guesses the next tokens from the
target's hidden states, k passes of one layer per target step.

Each sequence has a shadow: the head's KV (its own paged cache, one layer) for the
positions it has read with the target's real hidden states, and the hidden states the
target computed since, not yet read. After a step the head reads those (one chunk per
sequence: the tokens the target kept), which gives the first guess; each further guess
feeds the head its own predicted hidden state and the guess before. Those passes write
KV at positions the next step reads again with real inputs, so they are simply rewritten.

The head sees a sequence from the first position the target computed in this engine:
a prompt served from the prefix cache, or imported from a prefill worker, starts the
head there (rotary attention depends only on distances, so positions count from the
shadow's start). Fewer positions to read mean worse guesses, never wrong tokens.

Guesses are drawn as ``draw_guesses`` draws them: points for greedy and seeded requests,
the head's distribution under the request's parameters otherwise."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from worker.batch import ScheduledSequence
from worker.config import ConfigError, EngineConfig
from worker.kv.kv_cache_manager import KVCacheManager
from worker.models.decoder import DecoderModel
from worker.runner.model_runner import ModelRunner, is_chunk
from worker.sequence import Sequence
from worker.spec.eagle_head import load_eagle_head
from worker.spec.proposer import decoding, draw_guesses, forget_finished, guess_limit, register_proposer

HEADS_DIR = Path(__file__).parent / "heads"  # the heads Kervan ships, by catalog name


@dataclass
class EagleShadow:
    seq_id: str
    base: int  # the target position of the shadow's position 0
    token_ids: list[int] = field(default_factory=list)  # the head's input token at each position: x(base + j + 1)
    num_computed_tokens: int = 0  # positions whose head KV was made from the target's real hidden states
    pending: list[torch.Tensor] = field(default_factory=list)  # the target's hidden states not yet read
    num_pending: int = 0
    block_hashes: list = field(default_factory=list)  # none: the head caches no prefixes

    @property
    def next_position(self) -> int:
        """The target position of the next hidden state this shadow expects."""
        return self.base + self.num_computed_tokens + self.num_pending


class EagleProposer:
    reads_hidden = True

    def __init__(self, head_dir: str | Path | None, config: EngineConfig, target: DecoderModel, target_dir: Path):
        head_dir = Path(head_dir) if head_dir else shipped_head(target_dir)
        self.k = config.num_speculative_tokens
        self.max_model_len = config.max_model_len
        # no CUDA graphs: a graph's replay takes no hidden states in
        self.config = replace(config, speculative=None, speculative_model=None, enable_prefix_caching=False,
                              deterministic=False, quantization=None, enforce_eager=True)
        head = load_eagle_head(head_dir, target, config.dtype, config.max_model_len, config.device)
        self.vocab, self.vocab_size = head.vocab.cpu(), target.cfg.vocab_size
        self.runner = ModelRunner(head, self.config)
        self.runner.keep_hidden = True
        self.kv = KVCacheManager(self.config.num_kv_blocks, self.config.block_size, enable_caching=False)
        self.shadows: dict[str, EagleShadow] = {}

    def observe(self, scheduled: list[ScheduledSequence], hidden: dict[str, torch.Tensor]) -> None:
        for s in scheduled:
            seq, rows = s.sequence, hidden.get(s.sequence.seq_id)
            if rows is None or seq.is_finished:
                continue
            kept = seq.num_computed_tokens - s.num_computed  # rows whose tokens the sequence now holds
            shadow = self._shadow_at(seq.seq_id, s.num_computed)
            shadow.pending.append(rows[:kept].clone())
            shadow.num_pending += kept

    def _shadow_at(self, seq_id: str, position: int) -> EagleShadow:
        """The sequence's shadow, ready for hidden states from ``position`` on: a new one
        after a gap (a prefix the cache or another worker supplied), cut back when the
        target recomputes positions (a preempted sequence's second admission)."""
        shadow = self.shadows.get(seq_id)
        if shadow is not None and shadow.base <= position <= shadow.next_position:
            if position < shadow.next_position:
                keep = position - shadow.base
                if keep < shadow.num_computed_tokens:
                    shadow.num_computed_tokens, shadow.pending, shadow.num_pending = keep, [], 0
                else:
                    rows = torch.cat(shadow.pending)[:keep - shadow.num_computed_tokens]
                    shadow.pending, shadow.num_pending = [rows], len(rows)
                self.kv.trim(shadow, shadow.num_computed_tokens)
            return shadow
        if shadow is not None:
            self.kv.free(shadow)
        shadow = self.shadows[seq_id] = EagleShadow(seq_id, position)
        return shadow

    def propose(self, running: list[Sequence]) -> None:
        forget_finished(self.shadows, self.kv, running)
        plans: list[tuple[Sequence, EagleShadow, int]] = []
        for seq in decoding(running):
            seq.draft_tokens, seq.draft_probs = [], None
            limit = guess_limit(seq, self.k, self.max_model_len)
            shadow = self.shadows.get(seq.seq_id)
            # the head reads through the target's last computed position, whose hidden state predicts the next
            if not limit or shadow is None or not shadow.num_pending or shadow.next_position != seq.num_tokens - 1:
                continue
            shadow.token_ids = seq.token_ids[shadow.base + 1:]
            if self.kv.allocate_slots(shadow, shadow.num_pending + limit - 1) is not None:
                plans.append((seq, shadow, limit))
        if not plans:
            return
        probs: dict[str, list[torch.Tensor]] = {}
        # the first pass: each sequence's unread positions, with the target's hidden states
        first = [(seq, shadow, ScheduledSequence(shadow, shadow.num_computed_tokens, shadow.num_pending,
                                                 self.kv.get_block_ids(seq.seq_id), 1)) for seq, shadow, _ in plans]
        first.sort(key=lambda plan: is_chunk(plan[2]))  # decodes first, as the runner lays rows out
        features = torch.cat([row for _, shadow, _ in first for row in shadow.pending])
        for _, shadow, _ in first:
            shadow.num_computed_tokens += shadow.num_pending
            shadow.pending, shadow.num_pending = [], 0
        batch = [(seq, shadow) for seq, shadow, _ in first]
        guesses, predicted = self._pass([s for *_, s in first], features, batch, probs)
        limits = {seq.seq_id: limit for seq, _, limit in plans}
        for round_ in range(1, self.k):
            for (seq, shadow), guess in zip(batch, guesses):
                seq.draft_tokens.append(guess)
                shadow.token_ids.append(guess)
            keep = [i for i, (seq, _) in enumerate(batch) if limits[seq.seq_id] > round_]
            if not keep:
                break
            batch, predicted = [batch[i] for i in keep], predicted[keep]
            scheduled = [ScheduledSequence(shadow, shadow.num_computed_tokens + round_ - 1, 1,
                                           self.kv.get_block_ids(seq.seq_id), 1) for seq, shadow in batch]
            guesses, predicted = self._pass(scheduled, predicted, batch, probs)
        else:
            for (seq, _), guess in zip(batch, guesses):
                seq.draft_tokens.append(guess)
        for seq, _, _ in plans:
            if seq.seq_id in probs:
                seq.draft_probs = torch.stack(probs[seq.seq_id])

    def _pass(self, scheduled: list[ScheduledSequence], features: torch.Tensor, batch, probs):
        """One pass of the head: each sequence's guess, and the head's hidden state it came from."""
        step = self.runner.prepare(scheduled, self.kv.take_copies())
        logits = self.runner.forward(step, carried=features).cpu()
        predicted = self.runner.last_hidden[step.logit_rows]
        guesses = draw_guesses(self.runner.sampler, logits, [seq for seq, _ in batch], probs, self.vocab,
                               self.vocab_size)
        return guesses, predicted

    def close(self) -> None:
        for shadow in self.shadows.values():
            self.kv.free(shadow)
        self.shadows.clear()


def shipped_head(target_dir: Path) -> Path:
    """The head Kervan ships for a catalog model (``kervan pull``'s directory names it)."""
    try:
        name = json.loads((Path(target_dir) / "KERVAN_SOURCE.json").read_text())["name"]
    except (OSError, ValueError, KeyError):
        name = None
    if name is None or not (HEADS_DIR / name).is_dir():
        raise ConfigError(f"no EAGLE head ships for the model in {target_dir}: train one (python -m "
                          f"control_plane.tools.train_eagle --model {target_dir} --out DIR) and pass it as "
                          f"speculative_model")
    return HEADS_DIR / name


@register_proposer("eagle")
def _eagle(config: EngineConfig, target: DecoderModel, target_dir: Path) -> EagleProposer:
    return EagleProposer(config.speculative_model, config, target, target_dir)
