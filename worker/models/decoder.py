# mypy: disable-error-code="arg-type,misc,operator,union-attr,unreachable"
"""The Llama-family decoder, dense or mixture-of-experts.

Llama, Mistral, Qwen2 (attention biases, tied embeddings), Mixtral, Qwen2-MoE
(shared expert with a sigmoid gate) and GLM-4.5-style MoE (DeepSeek-V3 routing,
partial rotary) differ only in their config and tensor names, so one module
serves them all. The model is flat: it takes one step's tokens as a single
sequence ``[num_tokens]`` with their positions and the paged-attention metadata,
and returns hidden states; the runner picks which rows become logits.

A pipeline stage (``ParallelState.layer_range``) builds only its layers; the first
stage holds the embedding, the last the final norm and the LM head, and a stage
takes from the one before it, and hands the one after it, the last layer's output
and the residual stream (``carried``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from worker.config import MOE_NAMING, ModelConfig
from worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear, copy_checked
from worker.layers.mla import MlaAttention
from worker.layers.mlp import Loader, SwiGLU
from worker.layers.moe import SparseMoe
from worker.layers.norm import RMSNorm
from worker.layers.paged_attention import AttentionMetadata, paged_attention
from worker.layers.rotary import RotaryEmbedding
from worker.models.decode_stack import DecodeStack
from worker.parallel import get_parallel_state


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        ps = get_parallel_state()
        self.num_heads = cfg.num_heads // ps.tp_size
        self.num_kv_heads = max(1, cfg.num_kv_heads // ps.tp_size)  # fewer KV heads than ranks: one, replicated
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv = MergedColumnParallelLinear(cfg.hidden_size, [q, kv, kv], cfg.attention_bias, dtype, cfg.head_dim)
        self.o_proj = RowParallelLinear(q, cfg.hidden_size, False, dtype)
        self.rotary = rotary

    def loaders(self, prefix: str, has_bias: bool) -> dict[str, Loader]:
        out: dict[str, Loader] = {}
        for part, name in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{prefix}{name}.weight"] = lambda t, p=part: self.qkv.load(p, t)
            if has_bias:
                out[f"{prefix}{name}.bias"] = lambda t, p=part: self.qkv.load(p, t)
        out[f"{prefix}o_proj.weight"] = self.o_proj.load
        return out

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv.forward(x).split([q_size, kv_size, kv_size], dim=-1)
        q, k = self.rotary.forward(positions, q.view(n, self.num_heads, self.head_dim),
                           k.view(n, self.num_kv_heads, self.head_dim))
        out = paged_attention(q, k, v.view(n, self.num_kv_heads, self.head_dim), kv_cache, meta, self.scale)
        return self.o_proj.forward(out.view(n, q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, rotary: RotaryEmbedding, dtype: torch.dtype):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn: nn.Module = MlaAttention(cfg, rotary, dtype) if cfg.mla else Attention(cfg, rotary, dtype)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if index in cfg.moe_layers:
            self.mlp: nn.Module = SparseMoe(cfg.hidden_size, cfg.moe, dtype, MOE_NAMING[cfg.architecture].experts)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype)

    def loaders(self, prefix: str, cfg: ModelConfig) -> dict[str, Loader]:
        out = {f"{prefix}input_layernorm.weight": _copier(self.input_norm.weight),
               f"{prefix}post_attention_layernorm.weight": _copier(self.post_attn_norm.weight)}
        if isinstance(self.attn, MlaAttention):
            out.update(self.attn.loaders(f"{prefix}self_attn."))
        else:
            out.update(self.attn.loaders(f"{prefix}self_attn.", cfg.attention_bias))
        if isinstance(self.mlp, SparseMoe):
            naming = MOE_NAMING[cfg.architecture]
            out.update(self.mlp.loaders(f"{prefix}{naming.mlp}.", naming.shared))
        else:
            out.update(self.mlp.loaders(f"{prefix}mlp."))
        return out

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it); the next layer, or
        the final norm, adds the two. The first layer gets no residual."""
        if residual is None:
            x, residual = self.input_norm.forward(x), x
        else:
            x, residual = self.input_norm.forward(x, residual)
        x, residual = self.post_attn_norm.forward(self.attn.forward(positions, x, kv_cache, meta), residual)
        return self.mlp.forward(x), residual


class DecoderModel(nn.Module):
    # decode steps as one native call, embedding to logits, where the runner built one and runs it (``decode_stack.py``)
    decode_stack: DecodeStack | None = None

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.cfg = cfg
        ps = get_parallel_state()
        self.layer_range = ps.layer_range(cfg.num_layers)
        self.is_last_stage = ps.is_last_stage
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype) if ps.is_first_stage else None
        rotary = RotaryEmbedding(cfg.rope, max_positions, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, dtype) for i in self.layer_range)
        self.norm = self.lm_head = None
        if ps.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype)
            if cfg.tie_word_embeddings and self.embed is not None:
                self.lm_head.weight = self.embed.weight
                self.lm_head.keep_weight = True
        self.moes = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoe)]
        if self.moes:  # one count for all MoE layers: the load report reads it once per step
            self.routed_tokens = self.moes[0].routed_tokens
            for moe in self.moes[1:]:
                moe.routed_tokens = self.routed_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, carried: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states [num_tokens, hidden]; on a pipeline stage but the last,
        ``carried`` for the next: [2, num_tokens, hidden], the last layer's output and the
        residual stream (a stage but the first takes the previous one's instead of ids)."""
        x, residual = (self.embed(input_ids), None) if carried is None else (carried[0], carried[1])
        # submodules' forward is called directly here and in the layers: nn.Module.__call__'s hook
        # machinery cost ~2 us a call, 300 calls a decode step of a 30-layer model
        for layer, cache in zip(self.layers, kv_caches):
            x, residual = layer.forward(positions, x, residual, cache, meta)
        if self.norm is None:
            return torch.stack((x, residual))
        return self.norm(x, residual)[0]

    def batch_variant_layers(self) -> list[str]:
        """The layers whose kernel rounds a row by what else is in its call (oneDNN's layout,
        plain matmuls, dequantized tiles, latent attention's SDPA): none where a token's output
        is batch-invariant."""
        return variant_linears(self, self.dense_linears()) + [
            name for name, m in self.named_modules()
            if (m in self.moes and not m.is_batch_invariant()) or isinstance(m, MlaAttention)]

    def dense_linears(self) -> list[nn.Module]:
        """The layers whose weights the loader may pack: every dense linear and the LM head."""
        linears = [m for m in self.modules() if isinstance(m, (MergedColumnParallelLinear, RowParallelLinear))]
        return linears + ([self.lm_head] if self.lm_head is not None else [])

    def routed_tokens_per_rank(self) -> tuple[int, ...]:
        """(token, expert) pairs each rank of the group computed in the MoE layers since
        the start (the group's load balance); () for a dense model, and for a pipeline
        stage (which sees only its own layers' experts)."""
        if not self.moes or len(self.layer_range) < self.cfg.num_layers:
            return ()
        return tuple(self.moes[0].expert_map.tokens_per_rank(self.routed_tokens.tolist()))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [rows, vocab], in the model's dtype

    def loaders(self) -> dict[str, Loader]:
        """Checkpoint tensor name -> what keeps this rank's part of it."""
        out: dict[str, Loader] = {}
        if self.embed is not None:
            out["model.embed_tokens.weight"] = self.embed.load
        if self.lm_head is not None:
            out["model.norm.weight"] = _copier(self.norm.weight)
            tied = self.cfg.tie_word_embeddings
            if not tied or self.embed is None:  # a last stage without the embedding loads the tied head itself
                out["model.embed_tokens.weight" if tied else "lm_head.weight"] = self.lm_head.load
        for i, layer in zip(self.layer_range, self.layers):
            out.update(layer.loaders(f"model.layers.{i}.", self.cfg))
        return out

    def is_ignored_tensor(self, name: str) -> bool:
        """Tensors a checkpoint may carry that this rank does not use: another pipeline
        stage's, and ones no stage uses."""
        if "rotary_emb.inv_freq" in name or (self.cfg.tie_word_embeddings and name == "lm_head.weight"):
            return True
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            return True  # known names this stage's loaders do not take: another stage's
        parts = name.split(".")
        # another stage's layers, and multi-token-prediction layers past the decoder
        # stack (GLM-4.5, DeepSeek-V3)
        return len(parts) > 2 and parts[1] == "layers" and int(parts[2]) not in self.layer_range


def _copier(param: nn.Parameter) -> Loader:
    return lambda tensor: copy_checked(param.data, tensor)


def load_weights(model: DecoderModel, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into the model; every expected tensor must appear once."""
    loaders = model.loaders()
    missing = set(loaders)
    for name, tensor in tensors:
        fn = loaders.get(name)
        if fn is None:
            if model.is_ignored_tensor(name):
                continue
            raise ValueError(f"unexpected tensor {name!r} for {model.cfg.architecture}")
        try:
            fn(tensor)
        except ValueError as exc:
            raise ValueError(f"tensor {name!r}: {exc}") from None
        missing.discard(name)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {sorted(missing)[:3]}")


def variant_linears(model: nn.Module, linears: list[nn.Module]) -> list[str]:
    """The names of ``linears`` (modules of ``model``) whose kernel is not batch-invariant."""
    from worker.kernels import has_native_kernels
    native = has_native_kernels()

    def invariant(linear: nn.Module) -> bool:
        if linear.quant is not None:
            return native and linear.quant.codes.device.type == "cpu"  # the int8 or the direct kernel
        return linear.packed is not None and linear.packed.is_batch_invariant
    names = {id(m): name for name, m in model.named_modules()}
    return [names.get(id(m), "lm_head") for m in linears if not invariant(m)]
