"""Linear weights packed at load, one layout a layer: by default a batch-invariant one
(brgemm's where oneDNN's micro-kernel packs the dtype, else the invariant layout), the LM
head's included, replacing the weights (a tied head keeps its embedding's rows), side by
side in one arena; oneDNN's layout on request (``KERVAN_WEIGHT_PACKING=onednn``, reported as
batch-variant), plain weights with ``off``; any refusal leaves a model that loads and
computes the same logits on plain weights, with one warning."""

import logging

import pytest
import torch

from tests.conftest import make_prompts
from worker.kernels import has_native_kernels
from worker.layers import packing
from worker.layers.packing import PackKind, brgemm_packs
from worker.layers.paged_attention import AttentionMetadata
from worker.loader import load_model
from worker.platform import CpuInfo, Platform, current_platform
from worker.runner.model_runner import allocate_kv_caches

pytestmark = pytest.mark.isa
needs_kernels = pytest.mark.skipif(not has_native_kernels(), reason="the native kernels are not built")


def logits(model, prompt):
    n, cfg = len(prompt), model.cfg
    caches = allocate_kv_caches(cfg.num_layers, 5, cfg.num_kv_heads, 4, cfg.head_dim, model.norm.weight.dtype,
                                torch.device("cpu"))
    meta = AttentionMetadata.build(list(range(n)), [], [], [(0, n, 0, list(range(5)))], 4, torch.device("cpu"))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(prompt), torch.arange(n), caches, meta))


def packed_layers(model):
    return [m for m in model.dense_linears() if m.packed is not None]


def plain_model(path, dtype, monkeypatch):
    monkeypatch.setenv("KERVAN_WEIGHT_PACKING", "off")
    model = load_model(path, dtype, 512)
    monkeypatch.delenv("KERVAN_WEIGHT_PACKING")
    assert packed_layers(model) == []  # the switch works
    return model


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: the LM head is tied to the embedding
def test_every_linear_takes_a_batch_invariant_layout_and_gives_the_same_logits(hf_models, kind, dtype, monkeypatch):
    _, path = hf_models(kind)
    model = load_model(path, dtype, 512)
    layers = packed_layers(model)
    assert len(layers) == len(model.dense_linears()) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the head
    kinds = {m.packed.kind for m in layers}
    assert kinds == ({PackKind.BRGEMM} if dtype == torch.bfloat16 and brgemm_packs(dtype) else {PackKind.INVARIANT})
    assert model.batch_variant_layers() == []
    assert all(layer.weight is None for layer in layers if layer is not model.lm_head)  # no double memory
    assert (model.lm_head.weight is not None) == (kind == "qwen2")  # a tied head keeps the embedding's rows
    # side by side in step order (one arena on huge pages): each starts where the one before ends
    data = [m.packed.data for m in layers]
    assert all(b.data_ptr() == a.data_ptr() + a.nbytes for a, b in zip(data, data[1:]))
    prompt = make_prompts([19])[0]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(logits(model, prompt).float(), logits(plain_model(path, dtype, monkeypatch),
                                                                     prompt).float(), rtol=tolerance, atol=tolerance)


def test_onednns_layout_on_request_where_the_platform_packs(llama, monkeypatch):
    _, path = llama
    monkeypatch.setenv("KERVAN_WEIGHT_PACKING", "onednn")
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(path, dtype, 512)  # never crashes, whatever the CPU
        if current_platform().can_pack(dtype, "cpu"):
            assert {m.packed.kind for m in model.dense_linears()} == {PackKind.ONEDNN}
            assert len(model.batch_variant_layers()) == len(model.dense_linears())
        else:
            assert packed_layers(model) == [] and all(m.weight is not None for m in model.dense_linears())


def test_a_pack_that_is_refused_falls_back_to_plain_weights_with_one_warning(llama, monkeypatch, caplog):
    _, path = llama

    def refuse(weight, packed):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw\nmore")
    monkeypatch.setattr(packing, "_check", refuse)
    with caplog.at_level(logging.WARNING, logger="worker.layers.packing"):
        model = load_model(path, torch.float32, 512)
    if not has_native_kernels() and not current_platform().can_pack(torch.float32, "cpu"):
        pytest.skip("nothing packs float32 here")
    [record] = caplog.records
    assert "float32 linear weights cannot be packed" in record.message and "avx512bw" in record.message
    assert "more" not in record.message and packed_layers(model) == []
    assert model.batch_variant_layers()  # plain matmuls: a row rounds by its call
    prompt = make_prompts([19])[0]
    monkeypatch.undo()
    torch.testing.assert_close(logits(model, prompt), logits(plain_model(path, torch.float32, monkeypatch), prompt))


def packing_flags():
    return frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})


@pytest.mark.skipif("avx512bw" in current_platform().cpu.flags, reason="this CPU really can pack bf16")
def test_the_real_bf16_refusal_on_a_cpu_without_avx512_is_survived(llama, monkeypatch, caplog):
    """The crash of issue 9: a platform that wrongly claims bf16 packing, on a CPU that lacks it."""
    _, path = llama
    monkeypatch.setenv("KERVAN_WEIGHT_PACKING", "onednn")
    monkeypatch.setattr(packing, "current_platform", lambda: Platform(cpu=CpuInfo(
        arch="x86_64", model="", num_cores=2, flags=packing_flags() | {"avx2", "fma"}, torch_capability="AVX512")))
    with caplog.at_level(logging.WARNING, logger="worker.layers.packing"):
        model = load_model(path, torch.bfloat16, 512)
    assert packed_layers(model) == [] and len(caplog.records) == 1
    assert logits(model, make_prompts([7])[0]).isfinite().all()
