"""The int8-activation kernel (``quant_int8.cpp``), its weight layout (``int8_layout.py``)
and the choice between it and the float kernel (``kernel_choice.py``): one kernel a weight, for
every call, whatever its row count."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from worker.kernels import has_native_kernels
from worker.quant.int4 import quantize_int4
from worker.quant.int8 import quantize_int8
from worker.quant.int8_layout import code_offset
from worker.quant.matmul import quant_linear
from worker.quant.method import get_method
from worker.quant.weight import CodeFormat, QuantizedWeight

native = pytest.mark.skipif(not has_native_kernels() or not torch.ops.kervan.int8_instructions(),
                            reason="the native CPU kernels with an int8 dot are not built here")
pytestmark = pytest.mark.isa  # VNNI tiles of 16 and AVX2 tiles of 8: CI runs this file again capped to AVX2


def weights() -> dict[str, QuantizedWeight]:
    """One weight per code kind, 98 features (a tile's tail past 96) by 256 or 512 inputs."""
    gen = torch.Generator().manual_seed(0)

    def w(size):
        return torch.randn(98, size, generator=gen) * 0.05
    int4 = quantize_int4(w(256), 64)
    return {"int4-g64": int4, "int4-g32": quantize_int4(w(512), 32), "int4-g128": quantize_int4(w(256), 128),
            "int8": quantize_int8(w(512)),
            # Q4_0: 4-bit codes standing for -8..7, a float16 scale per 32, no zeros
            "q4_0": dataclasses.replace(quantize_int4(w(256), 32), format=CodeFormat.LUT4, zeros=None,
                                        lut=torch.arange(16, dtype=torch.float32) - 8, method="gguf-q4_0")}


def q8_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x rounded to int8 by blocks of 32 (amax / 127, to nearest even), in float64, times
    the dequantized weight: what the kernel computes, up to the order of float32 sums."""
    rows, size = x.shape
    blocks = x.float().view(rows, size // 32, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    x_hat = (torch.round(blocks * inverse) * scale).view(rows, size).double()
    return x_hat @ w.reference_dequantize(torch.float64).T


def with_int8(w: QuantizedWeight, terms: int = 1) -> QuantizedWeight:
    from worker.quant.kernel_choice import with_int8
    return with_int8(w, terms)


@native
@pytest.mark.parametrize("name", ["int4-g64", "int4-g32", "int4-g128", "int8", "q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_is_x_rounded_to_int8_times_the_weight(name, dtype):
    w = weights()[name]
    packed = with_int8(w)
    bias = torch.randn(98, generator=torch.Generator().manual_seed(1)).to(dtype)
    for rows in (1, 2, 3, 4, 5, 8, 13, 16, 33, 64, 300):
        x = torch.randn(rows, w.in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)
        got = quant_linear(x, packed, bias)
        assert got.shape == (rows, 98) and got.dtype == dtype
        want = q8_reference(x, w) + bias.double()
        # float32: only the order of float32 sums differs; bf16: the output's one rounding
        tolerance = 2e-6 if dtype == torch.float32 else 8e-3
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < tolerance, rows


@native
@pytest.mark.parametrize("name", ["int4-g32", "int8"])
@pytest.mark.parametrize("kernel", ["int8", "int8x2", "float"])
def test_rows_never_mix(name, kernel):
    """A row's result is the same bits alone and among the others of a call, at any row
    count (a decode step's, a prompt chunk's): batch-invariant, with either kernel."""
    w = weights()[name]
    packed = w if kernel == "float" else with_int8(w, terms=2 if kernel == "int8x2" else 1)
    x = torch.randn(300, packed.in_features, generator=torch.Generator().manual_seed(3))
    together = quant_linear(x, packed)
    for r in (0, 5, 15, 64, 299):
        assert torch.equal(quant_linear(x[r:r + 1], packed)[0], together[r])
        assert torch.equal(quant_linear(x[r:r + 37], packed)[0], together[r])


@native
def test_the_error_is_x_s_rounding_and_small():
    """Against the float kernel (x as it comes): within what rounding x to 8 bits per block
    costs, on a weight and activations of the real model's scale."""
    w = weights()["int4-g32"]
    x = torch.randn(4, w.in_features, generator=torch.Generator().manual_seed(4))
    exact = quant_linear(x, w)
    got = quant_linear(x, with_int8(w))
    assert not torch.equal(got, exact)
    assert ((got - exact).norm() / exact.norm()).item() < 0.01


@native
@pytest.mark.parametrize("name", ["int4-g32", "int8"])
def test_two_terms_are_x_and_its_remainder(name):
    """Two int8 terms: x's rounding, then the remainder's, the products added: against the
    float kernel about 1/100 of one term's error, and exactly x1 and x2 as separate rows."""
    w = weights()[name]
    x = torch.randn(3, w.in_features, generator=torch.Generator().manual_seed(6))
    exact = quant_linear(x, w)
    one, two = with_int8(w), with_int8(w, terms=2)
    err_one = ((quant_linear(x, one) - exact).norm() / exact.norm()).item()
    err_two = ((quant_linear(x, two) - exact).norm() / exact.norm()).item()
    assert err_two < err_one / 50
    blocks = x.view(3, -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    remainder = (blocks - torch.round(blocks * (1 / scale)) * scale).view(3, -1)
    want = quant_linear(x, one) + quant_linear(remainder, one)
    torch.testing.assert_close(quant_linear(x, two), want, rtol=1e-4, atol=5e-5)  # the remainder: an FMA there


@native
def test_zero_rows_and_a_zero_row():
    packed = with_int8(weights()["int4-g64"])
    assert quant_linear(torch.zeros(0, 256), packed).shape == (0, 98)
    assert torch.equal(quant_linear(torch.zeros(1, 256), packed), torch.zeros(1, 98))


def test_only_integer_codes_have_the_int8_path():
    assert code_offset(weights()["q4_0"]) == -8.0 and code_offset(weights()["int4-g64"]) == 0.0
    w = torch.randn(64, 256) * 0.05
    assert code_offset(get_method("nvfp4").quantize(w)) is None  # e2m1's values are not integers
    assert code_offset(get_method("fp8").quantize(w)) is None
    odd = dataclasses.replace(weights()["q4_0"], lut=torch.arange(16, dtype=torch.float32) * 0.5)
    assert code_offset(odd) is None


@native
def test_a_sliced_weight_drops_its_packed_codes():
    packed = with_int8(weights()["int4-g64"])
    assert packed.int8 is not None
    assert packed.rows(slice(0, 32)).int8 is None and packed.columns(0, 128).int8 is None


@native
@pytest.mark.parametrize("setting", ["float", "int8", "int8x2", "auto"])
def test_the_choice_is_set_on_every_quantized_weight(hf_models, monkeypatch, setting):
    """Forced or the default, never timed (every process of a mesh makes the same one); the
    LM head's integer kernel takes two int8 terms; a tied head and its embedding stay one
    matrix."""
    from worker.loader import load_model
    from worker.quant.kernel_choice import DEFAULT_KERNEL, choose_kernels
    from worker.quant.model import quantized_bytes, quantized_weights
    _, path = hf_models("qwen2")  # tied embeddings
    model = load_model(path, torch.float32, 64, quantization="int4-g32")
    before = quantized_bytes(model)["quantized"]
    monkeypatch.setenv("KERVAN_QUANT_ACTIVATIONS", setting)
    choices = choose_kernels(model)
    assert len(choices) == len({(tuple(w.shape), w.method) for w in quantized_weights(model)})
    head = (*model.lm_head.quant.shape, model.lm_head.quant.method)
    layers = [c for c in choices if (c.out_features, c.in_features, c.method) != head]
    [head_choice] = [c for c in choices if (c.out_features, c.in_features, c.method) == head]
    assert {c.reason for c in choices} == {"default" if setting == "auto" else "forced"}
    assert {c.kernel for c in layers} == {DEFAULT_KERNEL if setting == "auto" else setting}
    assert head_choice.kernel == ("float" if setting == "float" else "int8x2")
    terms = model.lm_head.quant.int8.terms if model.lm_head.quant.int8 is not None else 0
    assert terms == {"float": 0, "int8": 1, "int8x2": 2}[head_choice.kernel]
    for w in quantized_weights(model):
        chosen = next(c.kernel for c in choices if (c.out_features, c.in_features, c.method) == (*w.shape, w.method))
        assert (w.int8 is not None) == (chosen != "float")
    assert model.lm_head.quant is model.embed.quant
    packed = [w.int8.data for w in quantized_weights(model) if w.int8 is not None]
    assert quantized_bytes(model)["quantized"] == before + sum(p.nbytes for p in packed)  # the copy is counted
    if len(packed) > 1:  # one buffer, in the model's order: a step streams it front to back
        assert len({p.untyped_storage().data_ptr() for p in packed}) == 1
        assert [p.data_ptr() for p in packed] == sorted(p.data_ptr() for p in packed)


@native
def test_a_quantized_engine_with_int8_activations_answers_and_exports_its_choice(hf_models, monkeypatch):
    from services.worker.metrics import KernelChoiceCollector
    from worker import Engine, SamplingParams
    _, path = hf_models("llama")
    monkeypatch.setenv("KERVAN_QUANT_ACTIVATIONS", "int8")
    engine = Engine.from_pretrained(path, dtype="float32", quantization="int4-g32", num_kv_blocks=32)
    try:
        [out] = engine.generate([[5, 9, 13, 2, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 6
        [family] = KernelChoiceCollector(engine.runner.kernel_choices).collect()
        assert family.samples and {s.labels["kernel"] for s in family.samples} == {"int8", "int8x2"}  # the head
        assert {s.labels["reason"] for s in family.samples} == {"forced"}
    finally:
        engine.close()
