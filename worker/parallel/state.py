"""Which slice of the model this process owns.

A tensor-parallel group of ``tp_size`` ranks is one worker to the mesh: every rank
holds 1/tp_size of each column/row-parallel linear and of the vocabulary, and
the collectives below stitch the results. With one rank (the default here) every
collective is the identity, so the same layer code runs unchanged on one card or
many; ``torch.distributed`` is only touched when ``tp_size > 1``."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside [0, {self.tp_size})")

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """[start, end) of this rank's equal share of ``size`` items."""
        if size % self.tp_size:
            raise ValueError(f"{what} ({size}) is not divisible by tensor-parallel size {self.tp_size}")
        part = size // self.tp_size
        return self.tp_rank * part, (self.tp_rank + 1) * part

    def shard_heads(self, num_heads: int, head_dim: int, what: str) -> tuple[int, int]:
        """[start, end) in features of this rank's heads. With fewer heads than ranks
        (grouped-query KV heads) each head is replicated on ``tp_size / num_heads`` ranks:
        rank r holds head ``r * num_heads // tp_size``, the one its query heads read."""
        if num_heads % self.tp_size == 0:
            return self.shard(num_heads * head_dim, what)
        if self.tp_size % num_heads:
            raise ValueError(f"{what} ({num_heads}) neither divides nor is divisible by tensor-parallel size "
                             f"{self.tp_size}")
        head = self.tp_rank * num_heads // self.tp_size
        return head * head_dim, (head + 1) * head_dim


_STATE = ParallelState()
_SHM = None  # a ShmComm (shm_comm.py) when the group's ranks share a CPU host


def get_parallel_state() -> ParallelState:
    return _STATE


def set_parallel_state(state: ParallelState, shm=None) -> None:
    global _STATE, _SHM
    _STATE, _SHM = state, shm


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    if _SHM is not None and _SHM.fits(x):
        return _SHM.all_reduce(x)
    import torch.distributed as dist
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    if _SHM is not None and _SHM.fits(x):
        return _SHM.all_gather_last_dim(x)
    import torch.distributed as dist
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
