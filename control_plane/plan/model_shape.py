"""A model's size in the terms a plan needs: parameters, bytes of weights in a format,
KV bytes per token, and FLOPs per token, counted from its Hugging Face config.

Counts follow the layers Kervan runs (``worker/models``): per layer the q/k/v and o
projections (latent attention's: the query's, the latent's, ``kv_b_proj`` and o; its KV a
token is the latent, ``num_kv_heads`` 1 of half the latent's size in each of the key and value
planes), a SwiGLU MLP (gate, up, down) or routed experts of SwiGLU MLPs (plus shared
experts and the router), two RMSNorms; the embedding, a final norm and the LM head
(shared with the embedding when the config ties them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Bytes per weight of the decoder's linear layers in each format Kervan serves: codes plus
# their scales (and zeros) per group, as ``worker/quant`` and GGUF store them.
BYTES_PER_WEIGHT = {
    "float32": 4.0, "bfloat16": 2.0, "float16": 2.0,
    "int8": 1.0, "fp8": 1.0, "fp8-block": 1.0 + 4 / (128 * 128),
    "int4": 0.5 + 4 / 64, "int4-g32": 0.5 + 4 / 32, "int4-g128": 0.5 + 4 / 128,
    "nvfp4": 0.5 + 1 / 16,
    "gguf-q4_0": 18 / 32, "gguf-q4_1": 20 / 32, "gguf-q8_0": 34 / 32,
}
FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    tied_embeddings: bool
    num_experts: int = 0  # routed experts per MoE layer (0: dense)
    top_k: int = 0
    expert_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    num_moe_layers: int = 0
    attention_bias: bool = False  # q, k and v biases (Qwen2)
    shared_expert_gate: bool = False  # a gate on the shared experts' output (Qwen2-MoE)
    correction_bias: bool = False  # a routing bias per expert (DeepSeek-V3, GLM-4.5)
    # latent attention (DeepSeek): (kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank or 0)
    mla: tuple[int, int, int, int, int] | None = None

    @staticmethod
    def from_config(name: str, cfg: Any) -> ModelShape:
        """From a ``worker.config.ModelConfig`` (parsed by the worker's own reader)."""
        moe = cfg.moe
        return ModelShape(
            name=name, num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size, max_position=cfg.max_position, tied_embeddings=cfg.tie_word_embeddings,
            num_experts=moe.num_experts if moe else 0, top_k=moe.top_k if moe else 0,
            expert_intermediate_size=moe.intermediate_size if moe else 0,
            shared_intermediate_size=moe.shared_intermediate_size if moe else 0,
            num_moe_layers=len(cfg.moe_layers) if moe else 0, attention_bias=cfg.attention_bias,
            shared_expert_gate=bool(moe and moe.has_shared_expert_gate),
            correction_bias=bool(moe and moe.has_correction_bias),
            mla=None if cfg.mla is None else (cfg.mla.kv_lora_rank, cfg.mla.qk_nope_head_dim,
                                              cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim, cfg.mla.q_lora_rank or 0))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_params_per_layer(self) -> int:
        if self.mla is not None:
            rank, nope, rope, v, q_rank = self.mla
            q_out = self.num_heads * (nope + rope)
            q = self.hidden_size * q_rank + q_rank * q_out if q_rank else self.hidden_size * q_out
            return (q + self.hidden_size * (rank + rope) + rank * self.num_heads * (nope + v)
                    + self.num_heads * v * self.hidden_size)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.hidden_size * (q + 2 * kv) + q * self.hidden_size

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.expert_intermediate_size

    def mlp_params(self, experts: float) -> float:
        """Linear parameters of all MLPs with ``experts`` routed experts counted per MoE layer."""
        dense_layers = self.num_layers - self.num_moe_layers
        moe_layer = (experts * self.expert_params + 3 * self.hidden_size * self.shared_intermediate_size
                     + self.hidden_size * self.num_experts)
        return dense_layers * 3 * self.hidden_size * self.intermediate_size + self.num_moe_layers * moe_layer

    def linear_params(self, experts: float | None = None) -> float:
        """The decoder's linear weights (what a quantization format applies to), with every
        routed expert unless ``experts`` says how many per MoE layer."""
        return self.num_layers * self.attention_params_per_layer + self.mlp_params(
            self.num_experts if experts is None else experts)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def small_params(self) -> int:
        """Norms, biases and gates: vectors, kept in the float dtype whatever the format."""
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.attention_bias else 0
        if self.mla is not None:  # the latent's norm, and the query's where it is low-rank
            bias = self.mla[0] + self.mla[4]
        per_moe_layer = self.hidden_size * self.shared_expert_gate + self.num_experts * self.correction_bias
        return ((2 * self.num_layers + 1) * self.hidden_size + self.num_layers * bias
                + self.num_moe_layers * per_moe_layer)

    @property
    def num_params(self) -> int:
        head = 0 if self.tied_embeddings else self.lm_head_params
        return int(self.linear_params() + self.embedding_params + head + self.small_params)

    @property
    def active_params(self) -> int:
        """Parameters one token's forward multiplies by: its top-k experts, not all of them."""
        return int(self.linear_params(self.top_k if self.is_moe else None) + self.lm_head_params)

    def weight_bytes(self, weights: str, dtype: str) -> int:
        """Bytes of every weight: the linears in ``weights``' format, the embedding, LM head
        and norms in ``dtype`` (a GGUF keeps its own formats for them; counted as ``dtype``)."""
        head = 0 if self.tied_embeddings else self.lm_head_params
        rest = self.embedding_params + head + self.small_params
        return int(self.linear_params() * BYTES_PER_WEIGHT[weights] + rest * FLOAT_BYTES[dtype])

    def step_weight_bytes(self, weights: str, dtype: str, batch: int) -> float:
        """Weight bytes a decode step of ``batch`` sequences reads: every linear once (of an
        MoE layer, the experts its tokens chose: E * (1 - (1 - k/E)^batch) on average, for
        uniform routing), the LM head, and one embedding row per sequence."""
        experts = None
        if self.is_moe:
            experts = self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** batch)
        floats = FLOAT_BYTES[dtype]
        return (self.linear_params(experts) * BYTES_PER_WEIGHT[weights] + self.lm_head_params * floats
                + batch * self.hidden_size * floats)

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * FLOAT_BYTES[dtype]

    def flops_per_token(self, context: float) -> float:
        """Multiply-adds times two of one token's forward at ``context`` tokens of attention:
        the active linears, and QK^T plus attention-times-V over the context."""
        if self.mla is not None:  # absorbed: each head scores the latents (rank + rope) and sums their ranks
            rank, _, rope, _, _ = self.mla
            return 2 * self.active_params + 2 * self.num_layers * self.num_heads * (2 * rank + rope) * context
        return 2 * self.active_params + 4 * self.num_layers * self.num_heads * self.head_dim * context
