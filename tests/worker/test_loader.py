"""Loading Hugging Face directories: sharded checkpoints and clear errors."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import make_engine, make_prompts
from worker import SamplingParams
from worker.config import ConfigError
from worker.loader import load_model


@pytest.fixture
def llama_copy(llama, tmp_path):
    _, path = llama
    dst = tmp_path / "model"
    shutil.copytree(path, dst)
    return dst


def test_sharded_checkpoint_with_index_loads_identically(llama, llama_copy):
    _, path = llama
    tensors = load_file(llama_copy / "model.safetensors")
    (llama_copy / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, llama_copy / file)
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (llama_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    prompt = make_prompts([9])[0]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert (make_engine(llama_copy).generate([prompt], greedy)[0].token_ids
            == make_engine(path).generate([prompt], greedy)[0].token_ids)


def test_unknown_architecture_is_named(llama_copy):
    cfg = json.loads((llama_copy / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="MambaForCausalLM"):
        load_model(llama_copy, torch.float32, 64)


def test_missing_tensor_is_named(llama_copy):
    tensors = load_file(llama_copy / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, llama_copy / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(llama_copy, torch.float32, 64)


def test_misshaped_tensor_is_named(llama_copy):
    tensors = load_file(llama_copy / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, llama_copy / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(3, 64\)"):
        load_model(llama_copy, torch.float32, 64)


def test_directory_without_weights_is_refused(tmp_path, llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="safetensors"):
        load_model(llama_copy, torch.float32, 64)
    with pytest.raises(ConfigError, match="config.json"):
        load_model(tmp_path / "nowhere", torch.float32, 64)
