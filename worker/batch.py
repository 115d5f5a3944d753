"""The plan of one engine step, from the iteration scheduler (``engine/scheduler.py``) to
the model runner (``runner/``) and the speculative proposers (``spec/``): which sequences
run, how many of their tokens, in which blocks, and the block copies and imported KV to
apply before the forward. A neutral module, as vLLM's ``sched/output.py``: the runner and
the proposers import it, never the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from worker.sequence import Sequence


class BlockCopy(NamedTuple):
    """A block's contents copied before a step writes into it (copy-on-write of a shared block)."""

    src: int
    dst: int

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
