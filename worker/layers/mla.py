"""Multi-head latent attention (DeepSeek-V2/V3) over the paged KV pool.

A token's keys and values for every head are projections of one latent: ``c`` (kv_lora_rank,
normalised) and a rotary key ``k_rot`` (qk_rope_head_dim) shared by all heads. That latent is
what the pool caches, one per token and layer: its first half in the key plane of the pool's
one KV head, its second half in the value plane (``ModelConfig``: ``num_kv_heads`` 1,
``head_dim`` latent_size / 2). So every path that moves KV blocks (the prefill-to-decode
hand-off, the host and disk tiers, migration, the cluster tier) moves latents unchanged, and
a token costs ``latent_size`` values a layer, 576 for DeepSeek-V3 against 2 x 128 heads x 192
for its keys and values expanded.

Attention runs in the absorbed form (the DeepSeek-V2 paper's): head h's key for a token is
``W_UK[h] c`` and its value ``W_UV[h] c``, so a query's score is ``(W_UK[h]^T q_nope) . c +
q_rot . k_rot``: each query head is projected into the latent space once, attends over the
cached latents as one shared KV head of latent_size (values: the latents' first
kv_lora_rank), and its output is projected back through ``W_UV[h]``. No per-head keys or
values are ever made.

The checkpoint's rotary pairs are neighbours (V2 always, V3 with ``rope_interleave``); their
rows are permuted to halves when loaded (for the queries and the rotary key alike, so every
dot product is unchanged), and the model's rotate-half rotary applies. Tensor parallel: query
heads (``q_b_proj`` / ``q_proj``, ``kv_b_proj``) split by whole heads and ``o_proj`` by its
input, the latent's projection and norm replicated, so every rank caches every latent.

The attention itself is PyTorch's SDPA over latents gathered through the block tables (no
native kernel yet): decodes batched, each prompt chunk its own call, as ``paged_attention``'s
torch path. It is not batch-invariant, so ``--deterministic`` refuses these models."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as sdpa

from worker.config import MlaConfig, ModelConfig
from worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear, check_shape, copy_checked
from worker.layers.mlp import Loader
from worker.layers.norm import RMSNorm
from worker.layers.paged_attention import AttentionMetadata, cache_views
from worker.layers.rotary import RotaryEmbedding, yarn_mscale
from worker.parallel import get_parallel_state
from worker.quant.matmul import dequantize
from worker.quant.weight import QuantizedWeight


class MlaAttention(nn.Module):
    q_a_proj: MergedColumnParallelLinear | None
    q_a_norm: RMSNorm | None

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        if cfg.mla is None:
            raise ValueError(f"{cfg.architecture} has no latent attention")
        mla: MlaConfig = cfg.mla
        self.mla, self.rotary = mla, rotary
        self.qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        self.scale = self.qk_head_dim ** -0.5
        if cfg.rope.scaling_type == "yarn" and cfg.rope.mscale_all_dim:  # every dim's scale, not only the rotary's
            self.scale *= yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2
        self.num_kv_heads = 1  # the pool's: one latent per token
        ps = get_parallel_state()
        start, end = ps.shard_heads(cfg.num_heads, 1, "attention heads")
        self.num_heads = end - start  # this rank's
        heads = cfg.num_heads * self.qk_head_dim
        if mla.q_lora_rank:
            self.q_a_proj = _replicated(cfg.hidden_size, mla.q_lora_rank, dtype)
            self.q_a_norm = RMSNorm(mla.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.q_proj = MergedColumnParallelLinear(mla.q_lora_rank, [heads], False, dtype, self.qk_head_dim)
        else:
            self.q_a_proj = self.q_a_norm = None
            self.q_proj = MergedColumnParallelLinear(cfg.hidden_size, [heads], False, dtype, self.qk_head_dim)
        self.kv_a_proj = _replicated(cfg.hidden_size, mla.latent_size, dtype)
        self.kv_a_norm = RMSNorm(mla.kv_lora_rank, cfg.rms_norm_eps, dtype)
        # kv_b_proj, this rank's heads: [heads, nope + v, kv_lora_rank], read as W_UK and W_UV
        self.kv_b = nn.Parameter(torch.empty(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim,
                                             mla.kv_lora_rank, dtype=dtype), requires_grad=False)
        self.o_proj = RowParallelLinear(cfg.num_heads * mla.v_head_dim, cfg.hidden_size, False, dtype)

    def loaders(self, prefix: str) -> dict[str, Loader]:
        mla = self.mla
        out = {f"{prefix}kv_a_proj_with_mqa.weight": lambda t: self.kv_a_proj.load(0, self._rope_rows(
                   t, mla.latent_size, mla.kv_lora_rank)),
               f"{prefix}kv_a_layernorm.weight": lambda t: copy_checked(self.kv_a_norm.weight.data, t),
               f"{prefix}kv_b_proj.weight": self._load_kv_b,
               f"{prefix}o_proj.weight": self.o_proj.load}
        q = f"{prefix}q_b_proj.weight" if mla.q_lora_rank else f"{prefix}q_proj.weight"
        out[q] = lambda t: self.q_proj.load(0, self._rope_rows(t, self.qk_head_dim, mla.qk_nope_head_dim))
        if self.q_a_proj is not None and self.q_a_norm is not None:
            q_a_proj, q_a_norm = self.q_a_proj, self.q_a_norm
            out[f"{prefix}q_a_proj.weight"] = lambda t: q_a_proj.load(0, t)
            out[f"{prefix}q_a_layernorm.weight"] = lambda t: copy_checked(q_a_norm.weight.data, t)
        return out

    def _rope_rows(self, tensor: Any, period: int, rope_start: int) -> torch.Tensor:
        """All of ``tensor`` (float), its rotary rows in each ``period`` (from ``rope_start``)
        permuted from neighbouring pairs to halves where the checkpoint interleaves them."""
        t = _floats(tensor[:], self.kv_b.dtype)
        if not self.mla.rope_interleaved:
            return t
        rows = torch.arange(t.shape[0]).view(-1, period)
        rope = rows[:, rope_start:]
        rows[:, rope_start:] = torch.cat([rope[:, 0::2], rope[:, 1::2]], dim=1)
        return t[rows.flatten()]

    def _load_kv_b(self, tensor: Any) -> None:
        mla = self.mla
        per_head = mla.qk_nope_head_dim + mla.v_head_dim
        check_shape(tensor, (tensor.shape[0] // per_head * per_head, mla.kv_lora_rank))
        start, end = get_parallel_state().shard_heads(tensor.shape[0] // per_head, per_head, "attention heads")
        self.kv_b.data.copy_(_floats(tensor[start:end], self.kv_b.dtype).view(self.kv_b.shape))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        mla, n, h = self.mla, x.shape[0], self.num_heads
        nope, rank = mla.qk_nope_head_dim, mla.kv_lora_rank
        if self.q_a_proj is not None and self.q_a_norm is not None:
            x_q = self.q_a_norm.forward(self.q_a_proj.forward(x))
        else:
            x_q = x
        q = self.q_proj.forward(x_q).view(n, h, self.qk_head_dim)
        q_nope, q_rot = q[..., :nope], q[..., nope:]
        kv = self.kv_a_proj.forward(x)
        c, k_rot = kv[:, :rank], kv[:, rank:]
        q_rot, k_rot = self.rotary.forward(positions, q_rot.contiguous(), k_rot.contiguous().view(n, 1, -1))
        latent = torch.cat([self.kv_a_norm.forward(c.contiguous()), k_rot.view(n, -1)], dim=-1)
        write_latents(kv_cache, latent, meta)
        w_uk, w_uv = self.kv_b[:, :nope], self.kv_b[:, nope:]
        # each head's query in the latent space: [n, heads, kv_lora_rank + rope]
        q_latent = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rot], dim=-1)
        o_latent = latent_attention(q_latent, latent, kv_cache, meta, self.scale, mla.kv_lora_rank)
        o = torch.einsum("thr,hvr->thv", o_latent, w_uv)  # [n, heads, v_head_dim]
        return self.o_proj.forward(o.reshape(n, h * mla.v_head_dim))


def write_latents(kv_cache: torch.Tensor, latent: torch.Tensor, meta: AttentionMetadata) -> None:
    """The step's new latents [n, latent_size] into their slots: halves in the key and value planes."""
    half = latent.shape[1] // 2
    k, v = latent[:, :half].reshape(-1, 1, half), latent[:, half:].reshape(-1, 1, half)
    if meta.native:
        torch.ops.kervan.write_kv(kv_cache, k.contiguous(), v.contiguous(), meta.slots)
        return
    k_cache, v_cache = cache_views(kv_cache, half)
    k_cache[meta.slot_blocks, :, :, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, :, meta.slot_offsets] = v


def cached_latents(kv_cache: torch.Tensor, tables: torch.Tensor, half: int) -> torch.Tensor:
    """The latents of the blocks in ``tables`` [..., blocks] -> [..., blocks * block_size, 2 * half]."""
    k_cache, v_cache = cache_views(kv_cache, half)
    keys = k_cache[tables, 0].transpose(-1, -2)  # [..., blocks, block_size, half]
    values = v_cache[tables, 0]
    return torch.cat([keys, values], dim=-1).flatten(-3, -2)


def latent_attention(q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, value_size: int) -> torch.Tensor:
    """q [n, heads, latent_size] over the cached latents (keys: all of each, values: its first
    ``value_size``) -> [n, heads, value_size]."""
    out = q.new_empty(q.shape[0], q.shape[1], value_size)
    nd, half = meta.num_decodes, q.shape[-1] // 2
    if nd and meta.decode_tables is not None and meta.decode_lens is not None:
        ctx = cached_latents(kv_cache, meta.decode_tables, half)  # [nd, S, latent_size]
        mask = torch.arange(ctx.shape[1], device=q.device)[None, :] < meta.decode_lens[:, None]
        o = sdpa(q[:nd].unsqueeze(2), ctx.unsqueeze(1), ctx[..., :value_size].unsqueeze(1),
                 attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
        out[:nd] = o.squeeze(2)
    for span in meta.prefills:
        sl = slice(span.start, span.start + span.num_tokens)
        qs = q[sl].transpose(0, 1).unsqueeze(0)  # [1, heads, n, latent_size]
        if span.block_ids is None:  # no cached context: the chunk's own latents, causal
            ctx, causal = latent[sl], True
        else:
            ctx, causal = cached_latents(kv_cache, span.block_ids, half)[:span.num_context + span.num_tokens], False
        o = sdpa(qs, ctx[None, None], ctx[None, None, :, :value_size], attn_mask=None if causal else span.mask,
                 is_causal=causal, scale=scale, enable_gqa=True)
        out[sl] = o.squeeze(0).transpose(0, 1)
    return out


def _replicated(in_features: int, out_features: int, dtype: torch.dtype) -> MergedColumnParallelLinear:
    """A linear every rank holds whole (one 'head' of all its features)."""
    return MergedColumnParallelLinear(in_features, [out_features], False, dtype, out_features)


def _floats(value: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor's values in ``dtype`` (an FP8 checkpoint's quantized blocks dequantized)."""
    return dequantize(value, dtype) if isinstance(value, QuantizedWeight) else value.to(dtype)
