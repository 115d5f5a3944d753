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


def test_a_config_without_architectures_is_read_by_its_model_type(llama, llama_copy):
    """As transformers reads it (a config converted from GGUF, for one, has no "architectures")."""
    _, path = llama
    cfg = json.loads((llama_copy / "config.json").read_text())
    del cfg["architectures"]
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    prompt = make_prompts([9])[0]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert (make_engine(llama_copy).generate([prompt], greedy)[0].token_ids
            == make_engine(path).generate([prompt], greedy)[0].token_ids)
    cfg["model_type"] = "mamba"
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="mamba"):
        load_model(llama_copy, torch.float32, 64)


def test_a_qwen2_moe_config_naming_no_qkv_bias_loads_its_biases(hf_models, tmp_path):
    """Qwen1.5-MoE-A2.7B's published config.json names no qkv_bias, and its q, k and v carry biases
    all the same (transformers' default): they are loaded, not refused as unknown tensors."""
    _, path = hf_models("qwen2_moe")
    copy = tmp_path / "published"
    shutil.copytree(path, copy)
    cfg = json.loads((copy / "config.json").read_text())
    assert cfg.pop("qkv_bias") is True
    (copy / "config.json").write_text(json.dumps(cfg))
    prompt = make_prompts([9])[0]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert (make_engine(copy).generate([prompt], greedy)[0].token_ids
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


@pytest.mark.parametrize("layout", ["tensor", "expert", "pipeline"])
def test_a_rank_reads_only_its_part_of_the_checkpoint(hf_models, monkeypatch, layout):
    from worker.config import ModelConfig
    from worker.loader import CheckpointTensor
    from worker.parallel.state import ParallelState, set_parallel_state
    reads: dict[str, list[tuple[int, ...]]] = {}
    read = CheckpointTensor.__getitem__

    def spy(self, index):
        out = read(self, index)
        reads.setdefault(self.name, []).append(tuple(out.shape))
        return out

    monkeypatch.setattr(CheckpointTensor, "__getitem__", spy)
    path = hf_models("mixtral")[1]  # 2 layers of 4 experts
    cfg = ModelConfig.from_dir(path)
    sizes = {"tensor": (2, 1, 1), "expert": (1, 2, 1), "pipeline": (1, 1, 2)}[layout]
    set_parallel_state(ParallelState(1, *sizes))  # rank 1 of a group of 2: built and loaded, never run
    try:
        load_model(path, torch.float32, 64)
    finally:
        set_parallel_state(ParallelState())
    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    layer = "model.layers.1."
    expert = layer + "block_sparse_moe.experts.{}.w1.weight"
    if layout == "pipeline":  # stage 1 of 2: layer 1 and the head, whole; nothing of layer 0 or the embedding
        assert not [n for n in reads if n.startswith("model.layers.0.") or n == "model.embed_tokens.weight"]
        assert reads[layer + "self_attn.q_proj.weight"] == [(q, h)] and reads["lm_head.weight"] == [(cfg.vocab_size, h)]
    else:  # rank 1 holds experts 2 and 3, whole; 0 and 1 are never read
        assert expert.format(0) not in reads and expert.format(1) not in reads
        assert reads[expert.format(3)] == [(cfg.moe.intermediate_size, h)]
        q_rows = q // 2 if layout == "tensor" else q  # tensor parallel: its half of the heads
        assert reads[layer + "self_attn.q_proj.weight"] == [(q_rows, h)]


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/x.safetensors", ".."])
def test_an_index_naming_a_shard_outside_the_model_directory_is_refused(llama_copy, tmp_path, shard):
    """The index is data from whoever published the model: it may not make the worker read
    a file beside or above the model directory (which might exist: it is made here)."""
    shutil.copy(llama_copy / "model.safetensors", tmp_path / "outside.safetensors")
    names = list(load_file(llama_copy / "model.safetensors"))
    index = {"weight_map": {name: shard for name in names}}
    (llama_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="outside the model directory"):
        load_model(llama_copy, dtype=torch.float32, max_positions=64)
