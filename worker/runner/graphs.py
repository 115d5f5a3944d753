# mypy: disable-error-code="arg-type,return-value"
"""Decode steps replayed as CUDA graphs: one launch per step instead of one per kernel.

A decode step's shapes depend only on its batch size, so the runner captures the
model's forward once per batch-size bucket (``decode_buckets``: 1, 2, 4, 8, then
steps of 8 up to the largest batch) and replays the smallest bucket that holds a
step. Buckets are captured largest first into one shared memory pool (the smaller
graphs reuse the largest one's memory). A step is padded to its bucket with rows
that write and read only the padding block, a KV block past the block pool's
which no sequence ever owns (``pad_decode_step``), so padding touches no real KV.
Prefill steps, mixed steps and batches past the largest bucket run eagerly.

Inputs are copied into static buffers the graphs read: token ids, positions, KV
slots, block tables and the attention mask. Attention on this path gathers each
row's blocks up to the tables' fixed width, so the width is capped
(``GRAPH_MAX_CONTEXT`` tokens) and steps with a longer sequence run eagerly.
Capture is bounded (``max_capture_s``, and a floor of free memory): buckets it did
not reach run eagerly, and the log says how many were captured, in how long and
with how much memory. Models whose forward syncs with the host (the
mixture-of-experts dispatch counts tokens per expert) and worker groups run
eagerly; ``enforce_eager`` turns graphs off.

On the CPU there is no launch cost to remove, and ``torch.compile`` of a decode step
(``benchmarks/parallel.py``, ``cpu_compile``) was no faster than the native kernels
run eagerly, so the CPU runs eagerly and unpadded."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from worker.layers.paged_attention import AttentionMetadata
from worker.parallel.step_inputs import StepInputs

log = logging.getLogger(__name__)

GRAPH_MAX_CONTEXT = 4096  # tokens of the longest sequence a captured decode step serves


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes captured for decode: 1, 2, 4, 8, then steps of 8 up to ``max_batch``
    (which is always a bucket, so every batch the scheduler can form fits one)."""
    out = [b for b in (1, 2, 4, 8) if b < max_batch]
    out += range(16, max_batch, 8) if max_batch > 8 else []
    return [*out, max_batch]


def bucket_for(batch: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds ``batch`` rows (None: larger than all)."""
    return next((b for b in buckets if b >= batch), None)


def is_decode_only(step: StepInputs) -> bool:
    return not step.prefills and len(step.decode_tables) == len(step.token_ids) > 0


def pad_decode_step(step: StepInputs, bucket: int, pad_block: int, block_size: int) -> StepInputs:
    """``step`` with rows added up to ``bucket``: token 0 at position 0, writing its KV
    to the padding block's first slot and attending to it alone. Their outputs are
    never read (``logit_rows`` is unchanged)."""
    pad = bucket - len(step.token_ids)
    if pad < 0 or not is_decode_only(step):
        raise ValueError(f"can only pad a decode-only step of at most {bucket} rows")
    return StepInputs(block_copies=list(step.block_copies), token_ids=step.token_ids + [0] * pad,
                      positions=step.positions + [0] * pad, slots=step.slots + [pad_block * block_size] * pad,
                      decode_tables=step.decode_tables + [[pad_block]] * pad, decode_lens=step.decode_lens + [1] * pad,
                      logit_rows=list(step.logit_rows))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [bucket, hidden]: the output the graph writes


@dataclass
class CudaGraphRunner:
    """Captures and replays decode steps of ``model`` over ``kv_caches`` (one process, CUDA)."""

    model: torch.nn.Module
    kv_caches: list[torch.Tensor]
    block_size: int
    max_blocks: int  # the width of the static block tables; steps with longer sequences run eagerly
    pad_block: int
    buckets: list[int]
    graphs: dict[int, _Graph] = field(default_factory=dict)
    replays: int = 0

    def __post_init__(self) -> None:
        device = self.kv_caches[0].device
        largest = max(self.buckets)
        self.ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.slots = torch.zeros(largest, dtype=torch.long, device=device)
        self.tables = torch.zeros(largest, self.max_blocks, dtype=torch.long, device=device)
        self.lens = torch.ones(largest, dtype=torch.long, device=device)
        self.mask = torch.zeros(largest, 1, 1, self.max_blocks * self.block_size, dtype=torch.bool, device=device)

    def capture(self, max_capture_s: float = 60.0, min_free_bytes: int = 1 << 30) -> None:
        start = time.monotonic()
        free_before = torch.cuda.mem_get_info()[0]
        pool = None
        self._fill(None, max(self.buckets))  # every row padding: capture writes only the padding block
        for bucket in sorted(self.buckets, reverse=True):
            if time.monotonic() - start > max_capture_s or torch.cuda.mem_get_info()[0] < min_free_bytes:
                break
            side = torch.cuda.Stream()  # warm-up on a side stream (lazy initialisation must not be captured)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward_static(bucket)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward_static(bucket)
            pool = graph.pool()
            self.graphs[bucket] = _Graph(graph, hidden)
        torch.cuda.synchronize()
        used = free_before - torch.cuda.mem_get_info()[0]
        log.info("CUDA graphs: captured %d of %d decode buckets (%s) in %.1f s, %.0f MiB", len(self.graphs),
                 len(self.buckets), ",".join(map(str, sorted(self.graphs))), time.monotonic() - start, used / 2**20)

    def can_run(self, step: StepInputs) -> bool:
        return (is_decode_only(step) and bucket_for(len(step.token_ids), self.buckets) in self.graphs
                and max(map(len, step.decode_tables)) <= self.max_blocks)

    def run(self, step: StepInputs) -> torch.Tensor:
        """The hidden states of ``step``'s rows (a decode-only step ``can_run``), by replay."""
        bucket = self._fill(step, None)
        self.graphs[bucket].graph.replay()
        self.replays += 1
        return self.graphs[bucket].hidden[:len(step.token_ids)]

    def run_static(self, step: StepInputs) -> torch.Tensor:
        """What ``run`` computes, eagerly on the same static buffers (tests it on the CPU)."""
        bucket = self._fill(step, None)
        return self._forward_static(bucket)[:len(step.token_ids)]

    def _forward_static(self, bucket: int) -> torch.Tensor:
        """The model on the first ``bucket`` rows of the static buffers; under capture the
        metadata's derived tensors (slot blocks and offsets) are computed in the graph."""
        slots = self.slots[:bucket]
        meta = AttentionMetadata(native=False, slots=slots, slot_blocks=slots // self.block_size,
                                 slot_offsets=slots % self.block_size, num_decodes=bucket,
                                 decode_tables=self.tables[:bucket], decode_lens=self.lens[:bucket],
                                 decode_mask=self.mask[:bucket], prefills=[])
        return self.model(self.ids[:bucket], self.positions[:bucket], self.kv_caches, meta)

    def _fill(self, step: StepInputs | None, bucket: int | None) -> int:
        """Copy ``step`` padded to its bucket into the static buffers (None: ``bucket``
        rows of padding); returns the bucket."""
        if step is None:
            step = StepInputs(token_ids=[0], positions=[0], slots=[self.pad_block * self.block_size],
                              decode_tables=[[self.pad_block]], decode_lens=[1])
        bucket = bucket or bucket_for(len(step.token_ids), self.buckets)
        step = pad_decode_step(step, bucket, self.pad_block, self.block_size)
        device = self.ids.device
        self.ids[:bucket].copy_(torch.tensor(step.token_ids), non_blocking=True)
        self.positions[:bucket].copy_(torch.tensor(step.positions), non_blocking=True)
        self.slots[:bucket].copy_(torch.tensor(step.slots), non_blocking=True)
        tables = [table + [self.pad_block] * (self.max_blocks - len(table)) for table in step.decode_tables]
        self.tables[:bucket].copy_(torch.tensor(tables).to(device, non_blocking=True))
        self.lens[:bucket].copy_(torch.tensor(step.decode_lens), non_blocking=True)
        width = self.max_blocks * self.block_size
        self.mask[:bucket].copy_((torch.arange(width)[None, :] < torch.tensor(step.decode_lens)[:, None])
                                 [:, None, None, :].to(device, non_blocking=True))
        return bucket
