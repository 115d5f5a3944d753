"""Attention over a paged KV cache, in plain PyTorch, for mixed batches.

One step's tokens are laid out decodes first, then prefill chunks:

    tokens:  [ d0 d1 ... d(B-1) | p0 p0 p0 p0 | p1 p1 ... ]
              one query per      a chunk of a prompt, which may follow
              decoding request   cached context (prefix hit or earlier chunk)

Every layer first writes the step's new K/V into their slots, then reads. So a
request can attend to blocks another request of the same step is filling (two
requests sharing a prefix admitted together) and to its own earlier chunks.
Decodes run as one padded SDPA call over K/V gathered through their block
tables; each prefill chunk runs its own call with a causal mask offset by its
cached context. The masks and gather indices are built once per step in
``AttentionMetadata`` and reused by every layer.

Cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]."""

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
    slot_mapping: torch.Tensor  # [num_tokens] long: block_id * block_size + offset
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSpan]

    @staticmethod
    def build(slot_mapping: list[int], decode_tables: list[list[int]], decode_lens: list[int],
              prefills: list[tuple[int, int, int, list[int]]], block_size: int,
              device: torch.device) -> "AttentionMetadata":
        """prefills: (start, num_tokens, num_context, block_ids) per chunk."""
        tables = mask = None
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables],
                                  dtype=torch.long, device=device)
            lens = torch.tensor(decode_lens, device=device)
            mask = (torch.arange(width * block_size, device=device)[None, :] < lens[:, None])[:, None, None, :]
        spans = []
        for start, n, ctx, blocks in prefills:
            if ctx == 0:
                spans.append(PrefillSpan(start, n, 0, None, None))
                continue
            q_pos = torch.arange(ctx, ctx + n, device=device)[:, None]
            span_mask = torch.arange(ctx + n, device=device)[None, :] <= q_pos
            spans.append(PrefillSpan(start, n, ctx, torch.tensor(blocks, dtype=torch.long, device=device),
                                     span_mask))
        return AttentionMetadata(torch.tensor(slot_mapping, dtype=torch.long, device=device),
                                 len(decode_tables), tables, mask, spans)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)
    v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        # [num_decodes, max_blocks, block_size, kv_heads, head_dim] -> [num_decodes, kv_heads, S, head_dim]
        kd = kv_cache[0][meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
        vd = kv_cache[1][meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
        o = sdpa(q[:nd].unsqueeze(2), kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
        out[:nd] = o.squeeze(2)
    for span in meta.prefills:
        sl = slice(span.start, span.start + span.num_tokens)
        qs = q[sl].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        if span.block_ids is None:
            ks, vs = k[sl], v[sl]
            o = sdpa(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                     is_causal=True, scale=scale, enable_gqa=True)
        else:
            total = span.num_context + span.num_tokens
            ks = kv_cache[0][span.block_ids].flatten(0, 1)[:total]
            vs = kv_cache[1][span.block_ids].flatten(0, 1)[:total]
            o = sdpa(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                     attn_mask=span.mask, scale=scale, enable_gqa=True)
        out[sl] = o.squeeze(0).transpose(0, 1)
    return out
