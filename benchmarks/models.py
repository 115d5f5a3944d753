"""Random-weight models for benchmarks: the embedded default model's shape (512
hidden, 8 layers, GQA 8/4) with a real-sized vocabulary, so that the LM head
costs what it costs in a real model (with 32,000 ids: 58M parameters, about the
size of the models vLLM's CPU numbers here were measured on), a 125M-parameter
Llama, a Mixtral, and Llama-3.2-1B's shape at its own 128,256-id vocabulary (``SHAPES``). Written once into
the cache as an ordinary Hugging Face directory, without a tokenizer (benchmarks
send token ids)."""

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
}


def _weights(cfg: dict) -> dict:
    """Random tensors for ``cfg``: a Llama's, with each MLP made experts for a Mixtral."""
    out = random_weights(cfg, SEED)
    if cfg.get("tie_word_embeddings"):  # the LM head is the embedding
        del out["lm_head.weight"]
    experts = cfg.get("num_local_experts")
    if not experts:
        return out
    g = torch.Generator().manual_seed(SEED + 1)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    for i in range(cfg["num_hidden_layers"]):
        for name in ("gate_proj", "up_proj", "down_proj"):
            del out[f"model.layers.{i}.mlp.{name}.weight"]
        p = f"model.layers.{i}.block_sparse_moe."
        out[p + "gate.weight"] = normal(experts, h)
        for e in range(experts):
            out.update({f"{p}experts.{e}.w1.weight": normal(inter, h), f"{p}experts.{e}.w3.weight": normal(inter, h),
                        f"{p}experts.{e}.w2.weight": normal(h, inter)})
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
