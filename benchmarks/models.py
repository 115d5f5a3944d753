"""Random-weight models for benchmarks: the embedded default model's shape (512
hidden, 8 layers, GQA 8/4) with a real-sized vocabulary, so that the LM head
costs what it costs in a real model (with 32,000 ids: 58M parameters, about the
size of the models vLLM's CPU numbers here were measured on), a 125M-parameter
Llama, a Mixtral, Llama-3.2-1B's shape at its own 128,256-id vocabulary, and
Qwen1.5-MoE-A2.7B's layers (``SHAPES``). Written once into the cache as an
ordinary Hugging Face directory, without a tokenizer (benchmarks send token ids)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from kervan.envs import cache_dir
from worker.default_model import CONFIG, SEED, random_weights

# a GPT-2-small-sized Llama (about 125M parameters with 32,000 ids): the decode roofline
# is measured on a model of 100M+ parameters
SHAPES = {
    "default": {},
    "125m": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
             "num_key_value_heads": 4, "head_dim": 64},
    # SmolLM2-135M's shape (30 layers, hidden 576, GQA 9/3): its KV, 46 KB a token in float32, is what crosses
    # a link in the hand-off benchmarks
    "smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64},
    # a Mixtral of 8 experts (top 2) per layer, 6 layers, about 150M parameters with 32,000 ids
    "moe": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 768,
            "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 12, "num_key_value_heads": 4,
            "head_dim": 64, "num_local_experts": 8, "num_experts_per_tok": 2},
    # Llama-3.2-1B's published shape (16 layers, hidden 2,048, GQA 32:8, tied embeddings; 1.24B parameters
    # with its 128,256 ids): a model of real size, random weights (no hub here)
    "llama1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True,
                "max_position_embeddings": 131072, "rope_scaling": {
                    "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}},
    # Qwen1.5-MoE-A2.7B's published shape (hidden 2,048, 16 heads of 128, 60 experts of 1,408 with 4 routed a
    # token, a gated shared expert of 5,632, its 151,936 ids, untied) with 2 of its 24 layers, so that the model
    # in float32 twice over (Kervan and vLLM side by side) fits 24 GiB: 1.76B parameters, 1.04B in experts
    "qwen-moe": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
                 "intermediate_size": 5632, "num_hidden_layers": 2, "num_attention_heads": 16,
                 "num_key_value_heads": 16, "head_dim": 128, "num_experts": 60, "num_experts_per_tok": 4,
                 "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
                 "decoder_sparse_step": 1, "qkv_bias": True, "rope_theta": 1000000.0, "rope_scaling": None,
                 "rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "tie_word_embeddings": False},
}


# a MoE's checkpoint names: (MLP prefix, experts' count key, their width's key, gate/up/down names)
MOE_NAMES = {"MixtralForCausalLM": ("block_sparse_moe", "num_local_experts", "intermediate_size", ("w1", "w3", "w2")),
             "Qwen2MoeForCausalLM": ("mlp", "num_experts", "moe_intermediate_size",
                                     ("gate_proj", "up_proj", "down_proj"))}


def _weights(cfg: dict) -> dict:
    """Random tensors for ``cfg``: a Llama's, with each MLP made experts for a MoE."""
    out = random_weights(cfg, SEED)
    if cfg.get("tie_word_embeddings"):  # the LM head is the embedding
        del out["lm_head.weight"]
    names = MOE_NAMES.get(cfg.get("architectures", [""])[0])
    if names is None:
        return out
    mlp, count_key, width_key, (gate, up, down) = names
    experts, inter, h = cfg[count_key], cfg[width_key], cfg["hidden_size"]
    g = torch.Generator().manual_seed(SEED + 1)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    for i in range(cfg["num_hidden_layers"]):
        for name in ("gate_proj", "up_proj", "down_proj"):
            del out[f"model.layers.{i}.mlp.{name}.weight"]
        p = f"model.layers.{i}.{mlp}."
        if shared := cfg.get("shared_expert_intermediate_size"):  # Qwen2-MoE's gated shared expert
            out.update({p + "shared_expert.gate_proj.weight": normal(shared, h),
                        p + "shared_expert.up_proj.weight": normal(shared, h),
                        p + "shared_expert.down_proj.weight": normal(h, shared),
                        p + "shared_expert_gate.weight": normal(1, h)})
        if cfg.get("qkv_bias"):
            a = f"model.layers.{i}.self_attn."
            q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
            out.update({a + "q_proj.bias": normal(q), a + "k_proj.bias": normal(kv), a + "v_proj.bias": normal(kv)})
        out[p + "gate.weight"] = normal(experts, h)
        for e in range(experts):
            out.update({f"{p}experts.{e}.{gate}.weight": normal(inter, h),
                        f"{p}experts.{e}.{up}.weight": normal(inter, h),
                        f"{p}experts.{e}.{down}.weight": normal(h, inter)})
    return out


def ensure_random_model(vocab_size: int, shape: str = "default") -> Path:
    suffix = "" if shape == "default" else f"-{shape}"
    target = cache_dir() / f"kervan-bench-v{vocab_size}{suffix}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        cfg = dict(CONFIG, vocab_size=vocab_size, **SHAPES[shape])
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file(_weights(cfg), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.rename(tmp, target)
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
