"""Pipeline parallel: each rank of a worker group is a stage holding a contiguous range
of layers and their KV (``ParallelState.layer_range``).

Rank 0 (stage 0, the engine) cuts each step's batch into micro-batches of whole
sequences with about equal tokens (``split``), sends them all to the other stages
in one message, then runs its layers on each in turn and hands the result on.
Stage s takes micro-batch i from stage s - 1, runs its layers and hands it to stage
s + 1; the last stage computes the logits of the sampling rows and hands them back
to rank 0. So stage 0 works on micro-batch i + 1 while stage 1 works on i: with m
micro-batches and p stages a step takes m + p - 1 stage-times instead of m * p.

Every rank handles micro-batches in order, and each hand-over waits until the
taker took the previous one (one slot per inbox), so rank 0 takes the logits of
micro-batch i as soon as it has handed on micro-batch i + p - 1: no hand-over can
wait on one that waits on it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from worker.parallel.state import ParallelState, recv_from, send_to
from worker.parallel.step_inputs import StepInputs

# micro-batches per stage in a step: more shrinks the pipeline's idle time, but each one
# reads the stage's weights again (a decode step is bound by those reads)
MICRO_BATCHES_PER_STAGE = 1

T = TypeVar("T")


def split(items: Sequence[T], tokens: Callable[[T], int], parts: int) -> list[list[T]]:
    """Contiguous runs of ``items`` (at most ``parts``, none empty) with about equal tokens."""
    parts = max(1, min(parts, len(items)))
    total = sum(map(tokens, items))
    out: list[list[T]] = []
    done = 0
    for index, item in enumerate(items):
        # a new run once this one has its share, or when each item left must start one
        if not out or (len(out) < parts and (done >= total * len(out) / parts
                                             or len(items) - index <= parts - len(out))):
            out.append([])
        out[-1].append(item)
        done += tokens(item)
    return out


def run_first_stage(forward: Callable[[StepInputs], torch.Tensor], steps: list[StepInputs], ps: ParallelState,
                    vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """Rank 0: stage 0 of every micro-batch, handed on as it is done; returns the
    logits of all sampling rows in micro-batch order (None: no row samples)."""
    logits: list[torch.Tensor] = []

    def take(step: StepInputs) -> None:
        if step.logit_rows:
            logits.append(recv_from(ps.world - 1, (len(step.logit_rows), vocab_size), torch.float32, device))

    waiting: deque[StepInputs] = deque()  # handed on, logits not yet taken
    for step in steps:
        send_to(1, forward(step))
        waiting.append(step)
        if len(waiting) == ps.pp_size:
            take(waiting.popleft())
    while waiting:
        take(waiting.popleft())
    return torch.cat(logits) if logits else None


def run_later_stage(forward: Callable[[StepInputs, torch.Tensor], torch.Tensor | None], step: StepInputs,
                    ps: ParallelState, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """A peer: its stage of one micro-batch, between the stage before and the one after
    (or rank 0, which takes the last stage's logits)."""
    carried = recv_from(ps.rank - 1, (2, len(step.token_ids), hidden_size), dtype, device)
    out = forward(step, carried)
    if not ps.is_last_stage:
        if out is None:
            raise RuntimeError(f"pipeline stage {ps.rank} produced no hidden states for the next")
        send_to(ps.rank + 1, out)
    elif out is not None:
        send_to(0, out.float())
