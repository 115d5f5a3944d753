"""Which slice of the model this process owns, and the collectives between the slices.

A worker group is ``pp_size`` pipeline stages of ``width`` ranks each (rank =
stage * width + stage_rank), and the mesh sees it as one worker:
- tensor parallel (``tp_size`` = width): every rank of a stage holds 1/width of each
  column/row-parallel linear and of the vocabulary; the collectives stitch results;
- expert parallel (``ep_size`` = width): each rank holds whole experts
  (``ExpertMap``) and tokens travel to their experts' ranks and back (all-to-all);
  with ``tp_size`` 1 the rest of the stage (attention, dense MLPs) is replicated;
- pipeline parallel (``pp_size``): stage s holds a contiguous range of layers and
  their KV; activations go stage to stage (``pipeline.py``).
With one rank (the default) every collective is the identity, so the same layer
code runs unchanged on one card or many; ``torch.distributed`` is only touched in
a group. The collectives go through shared memory where the group has a segment
and the tensor fits (``shm_comm.py``), else through ``torch.distributed``; bytes
each rank sent to others are counted in ``TRAFFIC`` (the benchmark's all-to-all
bytes per token)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0  # in the worker group
    tp_size: int = 1
    ep_size: int = 1
    pp_size: int = 1

    def __post_init__(self) -> None:
        for a, b in (("tp_size", "ep_size"), ("ep_size", "tp_size")):
            if getattr(self, a) > 1 and getattr(self, b) not in (1, getattr(self, a)):
                raise ValueError(f"{a} {getattr(self, a)} and {b} {getattr(self, b)}: the two span the same "
                                 f"ranks of a stage, so they must be equal or one of them 1")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} outside [0, {self.world})")

    @property
    def width(self) -> int:
        """Ranks per pipeline stage."""
        return max(self.tp_size, self.ep_size)

    @property
    def world(self) -> int:
        return self.width * self.pp_size

    @property
    def stage_rank(self) -> int:
        return self.rank % self.width

    @property
    def pp_rank(self) -> int:
        return self.rank // self.width

    @property
    def tp_rank(self) -> int:
        return self.stage_rank if self.tp_size > 1 else 0

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """[start, end) of this rank's equal tensor-parallel share of ``size`` items."""
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

    def layer_range(self, num_layers: int) -> range:
        """The layers this rank's pipeline stage holds: contiguous, the first stages
        one more when they do not divide evenly."""
        return range(*split_points(num_layers, self.pp_size)[self.pp_rank:self.pp_rank + 2])

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def split_points(n: int, parts: int) -> list[int]:
    """Boundaries of ``n`` items cut into ``parts`` contiguous runs, the first ones
    one longer when they do not divide (``torch.tensor_split``'s rule)."""
    base, extra = divmod(n, parts)
    points = [0]
    for p in range(parts):
        points.append(points[-1] + base + (p < extra))
    return points


_STATE = ParallelState()
_SHM = None  # a ShmComm (shm_comm.py) when the group's ranks share a CPU host
TRAFFIC: Counter[str] = Counter()  # collective -> bytes this rank sent to other ranks
_SENDING: dict[int, tuple[Any, torch.Tensor]] = {}  # gloo: taker rank -> its hand-over in flight, and the tensor


def get_parallel_state() -> ParallelState:
    return _STATE


def set_parallel_state(state: ParallelState, shm=None) -> None:
    global _STATE, _SHM
    _STATE, _SHM = state, shm


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the ranks of the tensor-parallel stage (identity without one)."""
    if _STATE.tp_size == 1:
        return x
    TRAFFIC["all_reduce"] += _nbytes(x) * (_STATE.width - 1)
    if _SHM is not None and _SHM.fits(_nbytes(x)):
        return _SHM.all_reduce(x)
    import torch.distributed as dist
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    TRAFFIC["all_gather"] += _nbytes(x) * (_STATE.width - 1)
    if _SHM is not None and _SHM.fits(_nbytes(x)):
        return _SHM.all_gather_last_dim(x)
    import torch.distributed as dist
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def all_to_all_rows(x: torch.Tensor, send_counts: list[int], max_rows: int,
                    kind: str = "all_to_all") -> tuple[torch.Tensor, list[int]]:
    """Expert-parallel exchange over the stage's ranks: ``x`` [rows, ...] holds the rows
    for rank 0 first, then rank 1's, ... (``send_counts`` of each). Returns the rows the
    other ranks sent here, source rank by source rank, and how many came from each.
    ``max_rows``: a bound on any rank's rows that every rank computes alike (it decides
    shared memory or ``torch.distributed`` the same way everywhere)."""
    TRAFFIC[kind] += (sum(send_counts) - send_counts[_STATE.stage_rank]) * _row_bytes(x)
    if _SHM is not None and _SHM.fits_rows(max_rows, _row_bytes(x)):
        return _SHM.exchange_rows(x, send_counts)
    return _dist_all_to_all(x, send_counts)


def all_gather_rows(x: torch.Tensor, max_rows: int) -> torch.Tensor:
    """Every rank's rows of ``x`` (their numbers may differ), in rank order."""
    world = _STATE.width
    TRAFFIC["all_gather"] += len(x) * _row_bytes(x) * (world - 1)
    if _SHM is not None and _SHM.fits_rows(max_rows, _row_bytes(x)):
        return _SHM.exchange_rows(x, None)[0]
    return _dist_all_to_all(x.repeat(world, *[1] * (x.dim() - 1)), [len(x)] * world)[0]


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _row_bytes(x: torch.Tensor) -> int:
    return math.prod(x.shape[1:]) * x.element_size()


def _dist_all_to_all(x: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
    import torch.distributed as dist
    recv_counts = torch.empty(_STATE.width, dtype=torch.int64)
    dist.all_to_all_single(recv_counts, torch.tensor(send_counts, dtype=torch.int64))
    recv = recv_counts.tolist()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, list(send_counts))
    return out, recv


def send_to(dst: int, x: torch.Tensor) -> None:
    """Pipeline: hand ``x`` to rank ``dst`` (which knows its shape and dtype)."""
    TRAFFIC["pipeline"] += _nbytes(x)
    if _SHM is not None and _SHM.fits(_nbytes(x)):
        _SHM.send_to(dst, x)
        return
    import torch.distributed as dist
    x = x.contiguous()
    if dist.get_backend() != "gloo":
        dist.send(x, dst)
        return
    # gloo's send returns only once the taker receives; the pipeline's protocol hands on micro-batch
    # i + 1 before taking the logits of i (pipeline.py), which a blocking send deadlocks. One hand-over
    # in flight per taker, as shared memory's one slot: the previous one must have been taken first.
    previous = _SENDING.pop(dst, None)
    if previous is not None:
        previous[0].wait()
    _SENDING[dst] = (dist.isend(x, dst), x)


def recv_from(src: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
              ) -> torch.Tensor:
    """Pipeline: the next tensor rank ``src`` hands this one (on ``device``: NCCL
    receives into device memory)."""
    if _SHM is not None and _SHM.fits(math.prod(shape) * dtype.itemsize):
        return _SHM.recv(shape, dtype)
    import torch.distributed as dist
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(out, src)
    return out
