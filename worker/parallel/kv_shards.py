"""A worker group's KV in the handoff's layout: every layer, every KV head.

A prefill worker exports, and a decode worker imports, a prompt's KV as [layers, 2,
blocks, kv_heads, block_size * head_dim], whatever either side's group. Rank 0 of a
group gathers its ranks' parts into that layout (``gather``), and each rank keeps
its own part of what the group imports (``local_part``: tensor parallel, its KV
heads; pipeline, its layers; expert parallel, all of it, since attention is
replicated). So each side re-shards what it receives: a group of two hands KV to one
process or to a group of another size, and takes it from either."""

from __future__ import annotations

import torch

from worker.parallel.state import ParallelState, all_gather_last_dim, recv_from, send_to, split_points


def local_part(full: torch.Tensor, ps: ParallelState, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """This rank's layers and KV heads of ``full`` [layers, 2, blocks, kv_heads, width]."""
    layers = ps.layer_range(num_layers)
    start, end = ps.shard_heads(num_kv_heads, 1, "num_key_value_heads")
    return full[layers.start:layers.stop, :, :, start:end]


def gather(local: torch.Tensor, ps: ParallelState, num_layers: int, num_kv_heads: int) -> torch.Tensor | None:
    """Every rank calls it with its part; rank 0 gets the whole (the others None)."""
    if ps.pp_size > 1:  # each stage's layers, to rank 0 in stage order
        if ps.rank:
            send_to(0, local)
            return None
        points = split_points(num_layers, ps.pp_size)
        parts = [local] + [recv_from(stage, (points[stage + 1] - points[stage], *local.shape[1:]), local.dtype,
                                     local.device)
                           for stage in range(1, ps.pp_size)]
        return torch.cat(parts)
    if ps.tp_size > 1:  # rank r's heads at [r * local_heads, (r + 1) * local_heads)
        heads = all_gather_last_dim(local.movedim(3, -1).contiguous()).movedim(-1, 3)
        if num_kv_heads % ps.tp_size:  # fewer KV heads than ranks: head h first lives on rank h * tp / kv
            heads = heads[:, :, :, [h * ps.tp_size // num_kv_heads for h in range(num_kv_heads)]]
        return heads.contiguous() if ps.rank == 0 else None
    return local if ps.rank == 0 else None  # expert parallel: every rank holds all of it


def encode_write(block_ids: list[int], data: torch.Tensor) -> torch.Tensor:
    """A KV write for rank 0's message to its peers, as int64: the block count, the block
    ids, then the data's bytes (zero-padded to whole int64s)."""
    raw = data.contiguous().view(-1).view(torch.uint8)
    padded = torch.zeros(-(-len(raw) // 8) * 8, dtype=torch.uint8)
    padded[:len(raw)] = raw
    return torch.cat([torch.tensor([len(block_ids), *block_ids], dtype=torch.int64), padded.view(torch.int64)])


def decode_write(payload: torch.Tensor, dtype: torch.dtype,
                 block_shape: tuple[int, ...]) -> tuple[list[int], torch.Tensor]:
    """(block ids, data [layers, 2, blocks, *block_shape]) from ``encode_write``; a
    message of another size is refused."""
    count = int(payload[0]) if len(payload) else -1
    if count < 0 or len(payload) < 1 + count:
        raise ValueError(f"KV write message of {len(payload)} values names {count} blocks")
    layers_and_kv, rest = block_shape[:2], block_shape[2:]
    shape = (*layers_and_kv, count, *rest)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = payload[1 + count:].view(torch.uint8)
    if len(raw) != -(-nbytes // 8) * 8:
        raise ValueError(f"KV write message carries {len(raw)} bytes for {shape} {dtype} ({nbytes})")
    return payload[1:1 + count].tolist(), raw[:nbytes].view(dtype).view(shape).clone()
