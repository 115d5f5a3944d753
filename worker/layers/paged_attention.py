"""Attention over a paged KV cache, correct for mixed batches.

One step's tokens are laid out decodes first, then prefill chunks:

    tokens:  [ d0 d1 ... d(B-1) | p0 p0 p0 p0 | p1 p1 ... ]
              one query per      a chunk of a prompt, which may follow
              decoding sequence  cached context (prefix hit or earlier chunk)

Every layer first writes the step's new K/V into their slots, then reads. So a
sequence can attend to blocks another sequence of the same step is filling (two
requests sharing a prefix admitted together) and to its own earlier chunks.

Decodes run together: on the CPU through the native kernel that reads blocks in
place (``worker/kernels``, which also writes new K/V), elsewhere as one padded
SDPA call over K/V gathered through the block tables. Each prefill chunk runs its own SDPA call, with a causal
mask offset by its cached context. Index tensors and masks are built once per
step in ``AttentionMetadata`` and shared by all layers.

In deterministic mode every token is a row of the native decode kernel, attending
to its own prefix through its sequence's block table: one kernel whose reduction
over the keys runs block by block in the same order for a token in a decode step,
in any chunk of a prompt, after a cached or pushed prefix. SDPA's flash kernel
tiles the keys from the chunk's start instead, so the same token's output depended
on how its prompt was cut.

Cache layout per layer: [2, num_blocks, num_kv_heads, block_size * head_dim],
head-major inside a block so that one (block, head) is contiguous; keys are
stored transposed, [head_dim, block_size], values as [block_size, head_dim]
(the native kernel then scores a whole block with vector instructions)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa


@dataclass
class PrefillSpan:
    start: int  # first token of this chunk in the step's token layout
    num_tokens: int
    num_context: int  # tokens already in the cache before this chunk
    block_ids: torch.Tensor | None  # [num_blocks] long; None when there is no context
    mask: torch.Tensor | None  # [num_tokens, num_context + num_tokens] bool; None when no context


@dataclass
class AttentionMetadata:
    native: bool  # use the native CPU kernels (write_kv, paged_decode)
    slots: torch.Tensor  # [num_tokens] long: block_id * block_size + offset of each new token
    slot_blocks: torch.Tensor  # [num_tokens] long: slots // block_size (torch path)
    slot_offsets: torch.Tensor  # [num_tokens] long: slots % block_size (torch path)
    num_decodes: int
    decode_tables: torch.Tensor | None  # [num_decodes, max_blocks] long (padded with block 0)
    decode_lens: torch.Tensor | None  # [num_decodes] long: tokens to attend to, the new one included
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool; torch path only
    prefills: list[PrefillSpan]

    @staticmethod
    def build(slots: list[int], decode_tables: list[list[int]], decode_lens: list[int],
              prefills: list[tuple[int, int, int, list[int]]], block_size: int,
              device: torch.device, native: bool = False, per_token: bool = False) -> AttentionMetadata:
        """slots: block_id * block_size + offset per token; prefills: (start,
        num_tokens, num_context, block_ids) per chunk. ``per_token`` (deterministic
        mode, native kernels): every token of a prompt chunk is a decode row of its own."""
        slot = torch.tensor(slots, dtype=torch.long, device=device)
        tables = lens = mask = None
        if per_token:  # every prompt token a row of its own, attending to its prefix
            width = max(len(t) for t in decode_tables + [blocks for *_, blocks in prefills])
            tables = torch.cat([_padded(decode_tables, width)] + [_padded([blocks], width).expand(n, width)
                                                                 for _, n, _, blocks in prefills]).to(device)
            decode_lens = list(decode_lens) + [p for _, n, ctx, _ in prefills for p in range(ctx + 1, ctx + n + 1)]
            lens = torch.tensor(decode_lens, dtype=torch.long, device=device)
            return AttentionMetadata(native, slot, slot // block_size, slot % block_size, len(decode_lens), tables,
                                     lens, None, [])
        if decode_tables:
            tables = padded_tables(decode_tables).to(device)
            lens = torch.tensor(decode_lens, dtype=torch.long, device=device)
            if not native:
                keys = torch.arange(tables.shape[1] * block_size, device=device)
                mask = (keys[None, :] < lens[:, None])[:, None, None, :]
        spans = []
        for start, n, ctx, blocks in prefills:
            if ctx == 0:
                spans.append(PrefillSpan(start, n, 0, None, None))
                continue
            q_pos = torch.arange(ctx, ctx + n, device=device)[:, None]
            span_mask = torch.arange(ctx + n, device=device)[None, :] <= q_pos
            spans.append(PrefillSpan(start, n, ctx, torch.tensor(blocks, dtype=torch.long, device=device),
                                     span_mask))
        return AttentionMetadata(native, slot, slot // block_size, slot % block_size, len(decode_tables), tables,
                                 lens, mask, spans)


def padded_tables(tables: list[list[int]]) -> torch.Tensor:
    """[len(tables), the longest] long: block tables padded with block 0 (never read: a
    row's length stops before it)."""
    return _padded(tables, max(map(len, tables)))


def _padded(tables: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long).view(len(tables), width)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    if meta.native:
        torch.ops.kervan.write_kv(kv_cache, _dense_heads(k), _dense_heads(v), meta.slots)
        if not meta.prefills:  # decodes only (or deterministic mode's rows): the kernel's output is the answer
            return _decode(q, kv_cache, meta, scale)
    k_cache, v_cache = cache_views(kv_cache, k.shape[-1])
    if not meta.native:
        k_cache[meta.slot_blocks, :, :, meta.slot_offsets] = k
        v_cache[meta.slot_blocks, :, meta.slot_offsets] = v
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode(q[:nd], kv_cache, meta, scale)
    for span in meta.prefills:
        sl = slice(span.start, span.start + span.num_tokens)
        qs = q[sl].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        if span.block_ids is None:
            o = sdpa(qs, k[sl].transpose(0, 1).unsqueeze(0), v[sl].transpose(0, 1).unsqueeze(0),
                     is_causal=True, scale=scale, enable_gqa=True)
        else:
            total = span.num_context + span.num_tokens
            # [blocks, kv_heads, block_size, head_dim] -> [1, kv_heads, total, head_dim]
            ks = k_cache[span.block_ids].transpose(-1, -2).transpose(0, 1).flatten(1, 2)[:, :total].unsqueeze(0)
            vs = v_cache[span.block_ids].transpose(0, 1).flatten(1, 2)[:, :total].unsqueeze(0)
            o = sdpa(qs, ks, vs, attn_mask=span.mask, scale=scale, enable_gqa=True)
        out[sl] = o.squeeze(0).transpose(0, 1)
    return out


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    if meta.native:
        return torch.ops.kervan.paged_decode(_dense_heads(q), kv_cache, meta.decode_tables, meta.decode_lens, scale)
    k_cache, v_cache = cache_views(kv_cache, q.shape[-1])
    # [num_decodes, max_blocks, kv_heads, block_size, head_dim] -> [num_decodes, kv_heads, S, head_dim]
    kd = k_cache[meta.decode_tables].transpose(-1, -2).transpose(1, 2).flatten(2, 3)
    vd = v_cache[meta.decode_tables].transpose(1, 2).flatten(2, 3)
    o = sdpa(q.unsqueeze(2), kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
    return o.squeeze(2)


def _dense_heads(x: torch.Tensor) -> torch.Tensor:
    """x itself when its heads are dense (rows may be strided views into one qkv
    output, which the native kernels read in place), else a contiguous copy."""
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


def cache_views(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[2, blocks, kv_heads, block_size * head_dim] -> keys [blocks, kv_heads, head_dim,
    block_size] and values [blocks, kv_heads, block_size, head_dim], sharing memory."""
    num_blocks, num_kv_heads, width = kv_cache.shape[1:]
    block_size = width // head_dim
    return (kv_cache[0].view(num_blocks, num_kv_heads, head_dim, block_size),
            kv_cache[1].view(num_blocks, num_kv_heads, block_size, head_dim))
