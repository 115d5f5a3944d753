# mypy: disable-error-code="arg-type,assignment,union-attr"
"""Configuration for the engine: the model's shape (read from a Hugging Face
``config.json``) and the engine's own knobs. Both are frozen and validated on
construction; values discovered at run time (the number of KV blocks that fit a
memory budget) come back as a new object via ``dataclasses.replace``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kervan.engine_args import EngineArgs, EngineArgsError
from worker.platform import DtypeError, Platform, parse_dtype

DEFAULT_MAX_POSITION = 4096  # when config.json names no max_position_embeddings

# architectures the one decoder in worker/models/decoder.py serves
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Glm4MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
)


@dataclass(frozen=True)
class MoeNaming:
    """Where a family's checkpoint keeps a MoE layer's tensors (under ``model.layers.N.``)."""

    mlp: str  # the layer's MoE module
    experts: tuple[str, str, str]  # an expert's gate, up and down projections (``experts.E.<name>.weight``)
    shared: str = ""  # the shared expert's module, under ``mlp``


MOE_NAMING = {
    "MixtralForCausalLM": MoeNaming("block_sparse_moe", ("w1", "w3", "w2")),
    "Qwen2MoeForCausalLM": MoeNaming("mlp", ("gate_proj", "up_proj", "down_proj"), "shared_expert"),
    "Glm4MoeForCausalLM": MoeNaming("mlp", ("gate_proj", "up_proj", "down_proj"), "shared_experts"),
    "DeepseekV2ForCausalLM": MoeNaming("mlp", ("gate_proj", "up_proj", "down_proj"), "shared_experts"),
    "DeepseekV3ForCausalLM": MoeNaming("mlp", ("gate_proj", "up_proj", "down_proj"), "shared_experts"),
}
# multi-head latent attention (``worker/layers/mla.py``)
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# a config.json without "architectures" names its class by model_type, as transformers reads it
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# Qwen2's q, k and v projections carry a bias, and so do Qwen2-MoE's: their published config.json files
# (Qwen1.5-MoE-A2.7B's among them) name no qkv_bias, and transformers reads that as True
QKV_BIAS_BY_DEFAULT = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")


class ConfigError(ValueError):
    """A model directory or an engine option that Kervan cannot serve."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rotary_dim: int = 0  # the first rotary_dim channels of each head rotate
    scaling_type: str = "default"  # "default" | "llama3" | "linear" | "yarn"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # YaRN (DeepSeek-V2/V3's long context): the ramp between interpolated and extrapolated frequencies,
    # and the magnitude scales (cos and sin times attention_factor; latent attention's softmax scale
    # times mscale(mscale_all_dim) squared)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class MoeConfig:
    """Routed experts of one MoE layer type.

    scoring "softmax" is Mixtral / Qwen2-MoE / DeepSeek-V2; "sigmoid" is DeepSeek-V3 (scores
    plus a per-expert correction bias choose the experts, the raw scores weight them). With
    groups, tokens choose among the experts of their best ``topk_groups`` groups, a group scored
    by its best two experts' sum (DeepSeek-V3, GLM-4.5: ``group_score`` "top2") or its best one
    (DeepSeek-V2's group-limited greedy: "max")."""

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    has_correction_bias: bool = False
    shared_intermediate_size: int = 0
    has_shared_expert_gate: bool = False
    group_score: str = "top2"


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): each token's keys and values are one
    latent of ``kv_lora_rank`` plus a shared rotary key of ``qk_rope_head_dim``, cached as
    they are; each head's keys and values are projections of the latent (``kv_b_proj``)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # queries through a low-rank projection and its norm (V3), else one q_proj
    rope_interleaved: bool = True  # the checkpoint's rotary pairs are neighbours (permuted to halves at load)

    @property
    def latent_size(self) -> int:
        """Values cached per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float
    rope: RopeConfig
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    moe: MoeConfig | None = None
    moe_layers: tuple[int, ...] = ()  # layer indices whose MLP is the MoE block
    eos_token_ids: tuple[int, ...] = ()
    # latent attention: the KV pool's cells then hold each token's latent, half in the key plane and half
    # in the value plane of one KV head (``num_kv_heads`` 1, ``head_dim`` latent_size / 2)
    mla: MlaConfig | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        rotated = self.mla.qk_rope_head_dim if self.mla else self.head_dim
        if self.rope.rotary_dim % 2 or self.rope.rotary_dim > rotated:
            raise ConfigError(f"rotary dim {self.rope.rotary_dim} invalid for head_dim {rotated}")

    @staticmethod
    def from_dir(model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
        return ModelConfig.from_hf_dict(json.loads(path.read_text()))

    @staticmethod
    def from_hf_dict(cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if archs:
            arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        else:
            arch = ARCHITECTURE_OF_MODEL_TYPE.get(cfg.get("model_type", ""))
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"Kervan serves {', '.join(SUPPORTED_ARCHITECTURES)}")
        if cfg.get("use_qk_norm"):
            raise ConfigError(f"{arch} with use_qk_norm=true is not supported")
        if cfg.get("use_sliding_window"):
            raise ConfigError(f"{arch} with use_sliding_window=true is not supported")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        num_layers = cfg["num_hidden_layers"]
        moe, moe_layers = _parse_moe(arch, cfg, num_layers)
        mla = _parse_mla(arch, cfg)
        if mla is not None:  # one latent per token: a KV head whose key and value planes hold its halves
            head_dim, num_kv_heads = mla.latent_size // 2, 1
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 0),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position=cfg.get("max_position_embeddings", DEFAULT_MAX_POSITION),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=_parse_rope(cfg, mla.qk_rope_head_dim if mla else head_dim),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", arch in QKV_BIAS_BY_DEFAULT))),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            moe=moe,
            moe_layers=moe_layers,
            eos_token_ids=eos_ids,
            mla=mla,
        )


def _parse_rope(cfg: dict, head_dim: int) -> RopeConfig:
    # transformers >= 5 writes "rope_parameters"; older configs "rope_theta" + "rope_scaling"
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "llama3", "linear", "yarn"):
        raise ConfigError(f"rope type {kind!r} is not supported (default, linear, llama3, yarn)")
    yarn = {}
    if kind == "yarn":
        original = int(params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings") or 0)
        if original <= 0:
            raise ConfigError("yarn rope scaling needs original_max_position_embeddings")
        factor = params.get("factor") or cfg.get("max_position_embeddings", original) / original
        yarn = dict(factor=float(factor), original_max_position=int(original),
                    beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                    mscale=float(params.get("mscale") or 0), mscale_all_dim=float(params.get("mscale_all_dim") or 0),
                    attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)))
    return RopeConfig(**{
        "theta": float(theta),
        "rotary_dim": int(head_dim * partial),
        "scaling_type": kind,
        "factor": float(params.get("factor", 1.0)),
        "low_freq_factor": float(params.get("low_freq_factor", 1.0)),
        "high_freq_factor": float(params.get("high_freq_factor", 4.0)),
        "original_max_position": int(params.get("original_max_position_embeddings", 8192)),
        **yarn})


def _parse_moe(arch: str, cfg: dict, num_layers: int) -> tuple[MoeConfig | None, tuple[int, ...]]:
    if arch == "MixtralForCausalLM":
        moe = MoeConfig(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                        intermediate_size=cfg["intermediate_size"])
        return moe, tuple(range(num_layers))
    if arch == "Qwen2MoeForCausalLM":
        moe = MoeConfig(num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
                        intermediate_size=cfg["moe_intermediate_size"],
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                        shared_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
                        has_shared_expert_gate=True)
        step = cfg.get("decoder_sparse_step", 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        return moe, layers
    if arch == "Glm4MoeForCausalLM":
        moe = MoeConfig(num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
                        intermediate_size=cfg["moe_intermediate_size"], scoring="sigmoid",
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                        num_groups=cfg.get("n_group", 1), topk_groups=cfg.get("topk_group", 1),
                        has_correction_bias=True,
                        shared_intermediate_size=cfg["moe_intermediate_size"] * cfg.get("n_shared_experts", 0))
        return moe, tuple(range(cfg.get("first_k_dense_replace", 0), num_layers))
    if arch in MLA_ARCHITECTURES:
        v3 = arch == "DeepseekV3ForCausalLM"
        grouped = v3 or cfg.get("topk_method") == "group_limited_greedy"
        moe = MoeConfig(num_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
                        intermediate_size=cfg["moe_intermediate_size"], scoring="sigmoid" if v3 else "softmax",
                        norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)) if v3 else False,
                        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                        num_groups=(cfg.get("n_group") or 1) if grouped else 1,
                        topk_groups=(cfg.get("topk_group") or 1) if grouped else 1,
                        group_score="top2" if v3 else "max", has_correction_bias=v3,
                        shared_intermediate_size=cfg["moe_intermediate_size"] * (cfg.get("n_shared_experts") or 0))
        first, every = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
        return moe, tuple(i for i in range(first, num_layers) if i % every == 0)
    return None, ()


def _parse_mla(arch: str, cfg: dict) -> MlaConfig | None:
    if arch not in MLA_ARCHITECTURES:
        return None
    mla = MlaConfig(kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
                    qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                    q_lora_rank=cfg.get("q_lora_rank"),
                    # V2 rotates neighbouring pairs always (complex numbers); V3 where rope_interleave says so
                    rope_interleaved=arch == "DeepseekV2ForCausalLM" or bool(cfg.get("rope_interleave", True)))
    if mla.latent_size % 2:
        raise ConfigError(f"kv_lora_rank + qk_rope_head_dim ({mla.latent_size}) must be even: the KV pool holds "
                          "each token's latent in two halves")
    return mla


@dataclass(frozen=True, kw_only=True)
class EngineConfig(EngineArgs):
    """The engine's knobs: ``EngineArgs``'s fields (``kervan/engine_args.py``, where each is
    written once with its help), checked here against what needs torch and the engine's
    registries. ``num_kv_blocks`` None means: size the cache from ``kv_cache_memory_bytes``.
    ``dtype`` and ``device`` may be ``"auto"``: ``resolve`` asks the platform what they stand for."""

    # the one field held in another type: a torch dtype once parsed ("auto" until ``resolve``)
    dtype: torch.dtype | str = field(default="auto", metadata=EngineArgs.__dataclass_fields__["dtype"].metadata)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        except DtypeError as exc:
            raise ConfigError(str(exc)) from None
        try:
            super().__post_init__()
        except EngineArgsError as exc:
            raise ConfigError(str(exc)) from None
        if self.device != "auto" and _device_type(self.device) not in ("cpu", "cuda"):
            raise ConfigError(f"device {self.device!r} unknown; choose auto, cpu, cuda or cuda:N")
        if self.quantization is not None:
            from worker.quant.method import method_names

            if self.quantization not in method_names():
                raise ConfigError(f"quantization {self.quantization!r} unknown; choose one of "
                                  f"{', '.join(method_names())}")

    def bytes_per_block(self, model: ModelConfig) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * model.num_layers * self.block_size * model.num_kv_heads * model.head_dim * elem

    def host_tier_blocks(self, model: ModelConfig) -> int:
        """Blocks the host tier holds (0: no tier)."""
        return self.kv_host_bytes // self.bytes_per_block(model) if self.kv_host_bytes else 0

    def disk_tier_blocks(self, model: ModelConfig) -> int:
        """Blocks the disk tier holds (0: no tier)."""
        return self.kv_disk_bytes // self.bytes_per_block(model) if self.kv_disk_bytes else 0

    def resolve(self, model: ModelConfig, platform: Platform) -> EngineConfig:
        """Fill the values that depend on the hardware and the model; returns a new config."""
        device = platform.resolve_device(self.device)
        if device.startswith("cuda") and platform.cuda is None:
            raise ConfigError(f"device {self.device!r} requested but CUDA is not available")
        concrete = replace(self, device=device, dtype=platform.resolve_dtype(self.dtype, device))
        if self.deterministic and not device.startswith("cpu"):
            raise ConfigError(f"deterministic mode runs on the CPU's native kernels; on {device} Kervan has no "
                              f"batch-invariant attention and matmuls yet (use device='cpu')")
        check_parallel(model, self.tensor_parallel_size, self.expert_parallel_size, self.pipeline_parallel_size,
                       platform.num_ranks(device))
        num_blocks = self.num_kv_blocks or max(2, self.kv_cache_memory_bytes // concrete.bytes_per_block(model))
        if self.max_model_len and self.max_model_len > model.max_position:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's "
                              f"max_position_embeddings {model.max_position}")
        capacity = num_blocks * self.block_size
        if self.max_model_len and self.max_model_len > capacity:
            raise ConfigError(f"max_model_len {self.max_model_len} does not fit the KV cache "
                              f"({num_blocks} blocks x {self.block_size} = {capacity} tokens)")
        # unset: the model's limit, cut to what the KV cache holds (one sequence must always fit)
        max_len = self.max_model_len or min(model.max_position, capacity)
        return replace(concrete, num_kv_blocks=num_blocks, max_model_len=max_len)


def check_parallel(model: ModelConfig, tp: int, ep: int, pp: int, max_ranks: int) -> None:
    """Refuse, naming the numbers, a worker group this model or machine cannot take."""
    if tp > 1 and ep > 1 and tp != ep:
        raise ConfigError(f"tensor_parallel_size {tp} and expert_parallel_size {ep} span the same ranks of a "
                          f"stage: make them equal, or one of them 1")
    if pp > 1 and max(tp, ep) > 1:
        raise ConfigError(f"pipeline_parallel_size {pp} with tensor/expert parallel size {max(tp, ep)}: a worker "
                          f"group is one of the three for now (stages of one rank each)")
    world = max(tp, ep) * pp
    if world > max_ranks:
        raise ConfigError(f"a worker group of {world} ranks (tensor {tp} x expert {ep} x pipeline {pp}) exceeds "
                          f"the {max_ranks} ranks this machine can run (one per core on the CPU, one per GPU on "
                          f"CUDA)")
    if pp > model.num_layers:
        raise ConfigError(f"pipeline_parallel_size {pp} exceeds the model's {model.num_layers} layers")
    if ep > 1 and model.moe is None:
        raise ConfigError(f"expert_parallel_size {ep} needs a mixture-of-experts model; "
                          f"{model.architecture} has no experts")
    if ep > 1 and model.moe.num_experts % ep:
        raise ConfigError(f"expert_parallel_size {ep} does not divide num_experts ({model.moe.num_experts})")
    if tp > 1:
        _check_tensor_parallel(model, tp)


def _check_tensor_parallel(model: ModelConfig, size: int) -> None:
    parts = {"num_attention_heads": model.num_heads, "intermediate_size": model.intermediate_size,
             "vocab_size": model.vocab_size}
    if model.moe is not None:
        parts["num_experts"] = model.moe.num_experts  # whole experts per rank
        if model.moe.shared_intermediate_size:
            parts["shared_expert_intermediate_size"] = model.moe.shared_intermediate_size
    bad = [f"{name} ({value})" for name, value in parts.items() if value % size]
    if model.num_kv_heads % size and size % model.num_kv_heads:  # fewer KV heads than ranks are replicated
        bad.append(f"num_key_value_heads ({model.num_kv_heads}) and is no multiple of it")
    if bad:
        raise ConfigError(f"tensor_parallel_size {size} does not divide {', '.join(bad)}")


def _device_type(name: str) -> str | None:
    try:
        return torch.device(name).type
    except RuntimeError:
        return None
