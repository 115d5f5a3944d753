"""The benchmarks' random MoE checkpoints carry exactly the tensors transformers and Kervan's
loader expect for their architecture (``benchmarks/models.py``), at a tiny size."""

import json

import pytest
import torch
from safetensors.torch import save_file

from benchmarks.models import SHAPES, _weights
from worker.default_model import CONFIG
from worker.loader import load_model

TINY = {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_local_experts": 4, "num_experts": 4}


@pytest.mark.parametrize("shape", ["moe", "qwen-moe"])
def test_a_random_moe_checkpoint_has_every_tensor_of_its_architecture_and_no_other(shape, tmp_path):
    import transformers
    cfg = dict(CONFIG, vocab_size=128, **SHAPES[shape])
    cfg.update({k: v for k, v in TINY.items() if k in cfg})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(_weights(cfg), str(tmp_path / "model.safetensors"))
    model_cls = getattr(transformers, cfg["architectures"][0])
    _, info = model_cls.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    load_model(tmp_path, torch.float32, 64)  # raises on a missing, unexpected or misshaped tensor
