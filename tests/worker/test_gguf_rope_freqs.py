"""Llama 3 GGUFs carry their rope scaling as ``rope_freqs`` (a factor per frequency, what
llama.cpp's converter writes): the loader checks it against config.json's ``rope_scaling``
and reads on, and refuses a file whose factors disagree."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from worker.config import ConfigError, ModelConfig
from worker.layers.rotary import inverse_frequencies
from worker.quant.gguf import iter_gguf_tensors

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 4096, "rope_theta": 500000.0,
          "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}}


def llama3_factors(cfg: ModelConfig) -> np.ndarray:
    """What llama.cpp's converter computes for ``rope_freqs``: base frequency over scaled."""
    base = inverse_frequencies(ModelConfig.from_hf_dict({**CONFIG, "rope_scaling": None}).rope)
    return (base / inverse_frequencies(cfg.rope)).numpy().astype(np.float32)


def write(path, factors: np.ndarray) -> None:
    w = GGUFWriter(str(path), "llama")
    w.add_tensor("rope_freqs.weight", factors)
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_matching_rope_freqs_are_checked_and_left_out(tmp_path):
    cfg = ModelConfig.from_hf_dict(CONFIG)
    factors = llama3_factors(cfg)
    assert factors.max() == pytest.approx(32.0) and factors.min() == pytest.approx(1.0)  # the scaling is real
    write(tmp_path / "m.gguf", factors)
    assert [name for name, _ in iter_gguf_tensors(tmp_path / "m.gguf", cfg, torch.float32)] == ["model.norm.weight"]


def test_rope_freqs_that_disagree_with_the_config_are_a_config_error(tmp_path):
    cfg = ModelConfig.from_hf_dict(CONFIG)
    write(tmp_path / "m.gguf", llama3_factors(cfg) * 2)
    with pytest.raises(ConfigError, match="rope_freqs"):
        list(iter_gguf_tensors(tmp_path / "m.gguf", cfg, torch.float32))
