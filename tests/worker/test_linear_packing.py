"""oneDNN weight packing by capability: float32 packed wherever the platform says
it pays, bf16 only where the capped ISA allows it, and any refusal by oneDNN
leaves a model that loads and computes the same logits on plain weights."""

import logging

import pytest
import torch

from tests.conftest import make_prompts
from worker.layers import packing
from worker.layers.paged_attention import AttentionMetadata
from worker.loader import load_model
from worker.platform import CpuInfo, Platform, current_platform
from worker.runner.model_runner import allocate_kv_caches

pytestmark = pytest.mark.isa


def logits(model, prompt):
    n, cfg = len(prompt), model.cfg
    caches = allocate_kv_caches(cfg.num_layers, 5, cfg.num_kv_heads, 4, cfg.head_dim, model.embed.weight.dtype,
                                torch.device("cpu"))
    meta = AttentionMetadata.build(list(range(n)), [], [], [(0, n, 0, list(range(5)))], 4, torch.device("cpu"))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(prompt), torch.arange(n), caches, meta))


def packed_layers(model):
    return [m for m in model.dense_linears() if getattr(m, "packed_weight", None) is not None]


def plain_model(path, dtype, monkeypatch):
    monkeypatch.setenv("KERVAN_WEIGHT_PACKING", "off")
    model = load_model(path, dtype, 512)
    monkeypatch.delenv("KERVAN_WEIGHT_PACKING")
    assert packed_layers(model) == []  # the switch works
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: the LM head is tied to the embedding
def test_float32_weights_are_packed_where_it_pays_and_give_the_same_logits(hf_models, kind, monkeypatch):
    _, path = hf_models(kind)
    if not current_platform().can_pack(torch.float32, "cpu"):
        pytest.skip("float32 packing does not pay on this CPU")
    packed = load_model(path, torch.float32, 512)
    layers = packed_layers(packed)
    assert len(layers) == len(packed.dense_linears()) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the head
    assert all(layer.weight is None for layer in layers if layer is not packed.lm_head)  # no double memory
    assert (packed.lm_head.weight is not None) == (kind == "qwen2")  # a tied head keeps the embedding's rows
    prompt = make_prompts([19])[0]
    torch.testing.assert_close(logits(packed, prompt), logits(plain_model(path, torch.float32, monkeypatch), prompt),
                               rtol=1e-5, atol=1e-5)


def test_bf16_weights_are_packed_only_where_the_capped_isa_allows(llama, monkeypatch):
    _, path = llama
    model = load_model(path, torch.bfloat16, 512)  # never crashes, whatever the CPU
    prompt = make_prompts([19])[0]
    if current_platform().can_pack(torch.bfloat16, "cpu"):
        assert len(packed_layers(model)) == len(model.dense_linears())
        torch.testing.assert_close(logits(model, prompt).float(),
                                   logits(plain_model(path, torch.bfloat16, monkeypatch), prompt).float(),
                                   rtol=2e-2, atol=2e-2)  # bit for bit with oneDNN's layout: test_brgemm_linear
    else:
        assert packed_layers(model) == []
        assert all(layer.weight is not None for layer in model.dense_linears())


def test_a_pack_that_onednn_refuses_falls_back_to_plain_weights_with_one_warning(llama, monkeypatch, caplog):
    _, path = llama

    def refuse(weight, batch_hint):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw\nmore")
    monkeypatch.setattr(packing, "_reorder", refuse)
    monkeypatch.setattr(packing, "current_platform", lambda: Platform(cpu=CpuInfo(
        arch="x86_64", model="", num_cores=2, flags=frozenset({"avx2", "fma"}) | packing_flags(),
        torch_capability="AVX512")))
    with caplog.at_level(logging.WARNING, logger="worker.layers.packing"):
        model = load_model(path, torch.float32, 512)
    [record] = caplog.records
    assert "cannot pack float32" in record.message and "avx512bw" in record.message and "more" not in record.message
    assert packed_layers(model) == []
    prompt = make_prompts([19])[0]
    monkeypatch.undo()
    torch.testing.assert_close(logits(model, prompt), logits(plain_model(path, torch.float32, monkeypatch), prompt))


def packing_flags():
    return frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})


@pytest.mark.skipif("avx512bw" in current_platform().cpu.flags, reason="this CPU really can pack bf16")
def test_the_real_bf16_refusal_on_a_cpu_without_avx512_is_survived(llama, monkeypatch, caplog):
    """The crash of issue 9: a platform that wrongly claims bf16 packing, on a CPU that lacks it."""
    _, path = llama
    monkeypatch.setattr(packing, "current_platform", lambda: Platform(cpu=CpuInfo(
        arch="x86_64", model="", num_cores=2, flags=packing_flags() | {"avx2", "fma"}, torch_capability="AVX512")))
    with caplog.at_level(logging.WARNING, logger="worker.layers.packing"):
        model = load_model(path, torch.bfloat16, 512)
    assert packed_layers(model) == [] and len(caplog.records) == 1
    assert logits(model, make_prompts([7])[0]).isfinite().all()
