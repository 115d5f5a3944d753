"""Low-precision weights: the kernels against the plain PyTorch definition, each method
through the whole model against the float reference, and worker groups against one
process (tiny models from a seeded random init)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import make_prompts
from tests.worker.test_model_parity import model_logits, prompt_logits
from tests.worker.test_tensor_parallel import WORLD, run_ranks
from worker.kernels import has_native_kernels
from worker.quant.matmul import fp8_scaled_mm, quant_linear, tiled_linear
from worker.quant.method import get_method, method_names
from worker.quant.model import quantized_bytes
from worker.quant.nvfp4 import E2M1_VALUES, encode_e2m1
from worker.quant.weight import CodeFormat, QuantizedWeight, pack_nibbles

native = pytest.mark.skipif(not has_native_kernels(), reason="the native CPU kernels did not build here")
pytestmark = pytest.mark.isa  # the kernel's AVX-512 and AVX2 paths: CI runs this file again capped to AVX2
DTYPES = [torch.float32, torch.bfloat16]


def weight(out=96, size=256, seed=0):
    return torch.randn(out, size, generator=torch.Generator().manual_seed(seed)) * 0.05


@native
@pytest.mark.parametrize("name", method_names())
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_dequantizes_bit_for_bit_as_the_reference(name, dtype):
    q = get_method(name).quantize(weight())
    got = torch.ops.kervan.quant_dequantize(q.codes, q.scales, q.zeros, q.lut, int(q.format), q.group,
                                            q.tensor_scale, dtype)
    assert torch.equal(got, q.reference_dequantize(dtype))


@native
@pytest.mark.parametrize("name", method_names())
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16])
def test_the_kernel_matmul_is_dequantize_then_matmul(name, rows):
    """float32: the same products summed in another order (float32 rounding apart); rows
    of x never mix, so a row's result is the same in a call of any size."""
    q = get_method(name).quantize(weight(out=98))  # 98: a tail of output features past the blocks of 4
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(98)
    want = torch.nn.functional.linear(x, q.reference_dequantize(), bias)
    got = torch.ops.kervan.quant_matmul(x, q.codes, q.scales, q.zeros, q.lut, int(q.format), q.group,
                                        q.tensor_scale, bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    alone = torch.ops.kervan.quant_matmul(x[-1:], q.codes, q.scales, q.zeros, q.lut, int(q.format), q.group,
                                          q.tensor_scale, bias)
    assert torch.equal(alone[0], got[-1])


def q4_0_like(out: int, size: int, lut: torch.Tensor, seed: int = 0) -> QuantizedWeight:
    """A LUT4 weight as GGUF's Q4_0 stores one (random codes, float16 scales per 32)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (out, size // 2), dtype=torch.uint8, generator=g)
    scales = (torch.rand(out, size // 32, generator=g) * 0.01 + 0.001).half()
    return QuantizedWeight(codes, scales, None, lut, CodeFormat.LUT4, 32, size)


def bf16_weights() -> list[QuantizedWeight]:
    """Every method, and Q4_0's table, at widths whole in 128-element chunks (256), 64 past
    them (576: SmolLM2's hidden size) and one chunk and a half (192)."""
    out = [get_method(name).quantize(weight(out=98, size=size, seed=size))
           for name in method_names() for size in (256, 576, 192) if size % get_method(name).block == 0]
    # every e4m3 code but NaN's (0x7F, 0xFF), subnormals included, in every column over the rows
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F] + [0x00, 0x80], dtype=torch.uint8)
    every = torch.stack([codes.roll(i) for i in range(98)])
    out.append(QuantizedWeight(every, torch.full((98, 1), 0.01), None, None, CodeFormat.E4M3, 256, 256, method="e4m3"))
    return out + [q4_0_like(98, size, torch.arange(16, dtype=torch.float32) - 8) for size in (256, 576)]


@native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
def test_bf16_activations_are_dequantize_then_matmul_rounded_once(rows):
    """bf16 x: the AVX512_BF16 path (``quant_bf16.h``; where the CPU lacks it, the float32
    path) sums exact products in float32, so the result is the float64 reference rounded
    to bf16, give or take one bf16 step; and a row alone gets the same bits as in a call."""
    for q in bf16_weights():
        x = torch.randn(rows, q.in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
        want = (x.double() @ q.reference_dequantize().double().T)
        got = quant_linear(x, q)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=1e-4, msg=f"{q.method} K={q.in_features}")
        alone = quant_linear(x[-1:].clone(), q)
        assert torch.equal(alone[0], got[-1]), f"{q.method} K={q.in_features}"


@native
def test_a_table_bf16_cannot_hold_takes_the_float32_path():
    """A 4-bit table with values bf16 would round (0.1, ...) is computed in float32 even
    for bf16 x: the same bits as float32 x's result rounded to bf16."""
    lut = torch.linspace(-0.73, 0.81, 16)
    assert not torch.equal(lut.bfloat16().float(), lut)
    q = q4_0_like(98, 576, lut)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(quant_linear(x, q), quant_linear(x.float(), q).bfloat16())


@pytest.mark.parametrize("rows", [2, 40])
def test_long_calls_take_dequantized_tiles_and_agree(rows, monkeypatch):
    monkeypatch.setattr("worker.quant.matmul.TILE_ELEMENTS", 256 * 32)  # several tiles of 32 rows
    q = get_method("int4").quantize(weight())
    x = torch.randn(rows, 256).bfloat16()
    want = torch.nn.functional.linear(x, q.reference_dequantize(torch.bfloat16))
    assert torch.equal(tiled_linear(x, q, None), want)
    torch.testing.assert_close(quant_linear(x, q).float(), want.float(), rtol=2e-2, atol=2e-2)


def test_fp8_scaled_mm_path_matches_the_weight_only_reference():
    """The FP8 tensor-core path (per-token e4m3 activations, ``torch._scaled_mm``), run
    where PyTorch runs it on the CPU: within the activations' e4m3 rounding of the reference."""
    q = get_method("fp8").quantize(weight())
    x = torch.randn(5, 256).bfloat16()
    want = torch.nn.functional.linear(x.float(), q.reference_dequantize())
    got = fp8_scaled_mm(x, q, None).float()
    assert got.dtype == torch.float32 and ((got - want).norm() / want.norm()) < 0.05


def test_quantization_error_and_bytes_per_method():
    w = weight(256, 512)
    bf16 = w.numel() * 2
    errors, ratios = {}, {}
    for name in method_names():
        q = get_method(name).quantize(w)
        errors[name] = float((q.reference_dequantize() - w).norm() / w.norm())
        ratios[name] = q.nbytes / bf16
    assert errors["int8"] < 0.01 and errors["fp8"] < 0.04 and errors["fp8-block"] < 0.04
    assert errors["int4-g32"] < errors["int4"] < errors["int4-g128"] < 0.11 and errors["nvfp4"] < 0.11
    assert ratios["int4"] <= 0.3 and ratios["int4-g128"] <= 0.3 and ratios["nvfp4"] <= 0.3
    assert 0.5 <= ratios["int8"] < 0.51


def test_e2m1_rounds_to_nearest_with_ties_to_even():
    x = torch.tensor([0.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.74, -6.0])
    assert E2M1_VALUES[encode_e2m1(x)].tolist() == [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -6.0]


def test_slices_are_whole_rows_or_whole_groups():
    q = get_method("int4-g32").quantize(weight())
    full = q.reference_dequantize()
    assert torch.equal(q[10:20].reference_dequantize(), full[10:20])
    assert torch.equal(q[:, 64:128].reference_dequantize(), full[:, 64:128])
    with pytest.raises(ValueError, match="split a quantization group"):
        q[:, 16:48]


def test_nibble_order_is_gguf_s():
    codes = torch.arange(32).remainder(16).view(1, 32)
    packed = pack_nibbles(codes)
    assert packed[0, :2].tolist() == [0 | (0 << 4), 1 | (1 << 4)]  # byte j: element j, element j + 16
    q = QuantizedWeight(packed, torch.ones(1, 1), None, None, CodeFormat.UINT4, 32, 32)
    assert q.values()[0].tolist() == codes[0].float().tolist()


@pytest.mark.parametrize("kind", ["qwen2", "mixtral"])
@pytest.mark.parametrize("name", ["int8", "int4-g32", "fp8", "nvfp4"])
def test_a_quantized_model_computes_its_dequantized_weights(hf_models, kind, name):
    """The whole model quantized at load equals the same model given its weights
    dequantized back to float (float32, summation order apart), and stays near the float
    original: int8 keeps every greedy token of the prompt (the real model's quality per
    method is ``benchmarks/quantization.py``'s: a random tiny model's logits are too close
    for more)."""
    from worker.loader import load_model
    _, path = hf_models(kind)
    prompt = make_prompts([23], seed=5)[0]
    model = load_model(path, torch.float32, 512, quantization=name)
    got = model_logits(model, prompt)
    _dequantize_in_place(model)
    torch.testing.assert_close(got, model_logits(model, prompt), rtol=1e-4, atol=1e-4)
    if name == "int8" and kind == "qwen2":
        assert torch.equal(got.argmax(-1), prompt_logits(path, prompt).argmax(-1))


def _dequantize_in_place(model):
    """Every quantized matrix back to float parameters: the plain dequantize-then-matmul model."""
    from torch import nn
    for module in model.modules():
        quant = getattr(module, "quant", None)
        if quant is not None:
            module.quant = None
            module.weight = nn.Parameter(quant.reference_dequantize(), requires_grad=False)
        experts = getattr(module, "expert_quants", None)
        if experts:
            module.w13 = nn.Parameter(torch.stack([a.reference_dequantize() for a, _ in experts]), requires_grad=False)
            module.w2 = nn.Parameter(torch.stack([b.reference_dequantize() for _, b in experts]), requires_grad=False)
            module.expert_quants = None


def test_quantized_bytes_count_a_tied_matrix_once(hf_models):
    from worker.loader import load_model
    _, path = hf_models("qwen2")  # tied embeddings
    model = load_model(path, torch.float32, 64, quantization="int4-g32")
    assert model.lm_head.quant is model.embed.quant
    sizes = quantized_bytes(model)
    assert sizes["quantized"] == sum(q.nbytes for q in {id(m.quant): m.quant for m in model.modules()
                                                        if getattr(m, "quant", None) is not None}.values())


@pytest.mark.parametrize("quantized_first", [True, False])
def test_a_merged_linear_refuses_float_and_quantized_parts_mixed(quantized_first):
    from worker.layers.linear import MergedColumnParallelLinear
    layer = MergedColumnParallelLinear(64, [32, 32], False, torch.float32)
    parts = [get_method("int8").quantize(weight(32, 64)), weight(32, 64, seed=1)]
    layer.load(0, parts[0] if quantized_first else parts[1])
    with pytest.raises(ValueError, match="mix float and quantized"):
        layer.load(1, parts[1] if quantized_first else parts[0])


def test_an_unknown_method_is_a_config_error():
    from worker.config import ConfigError, EngineConfig
    with pytest.raises(ConfigError, match="quantization 'int3' unknown"):
        EngineConfig(quantization="int3")



def _rank_main(rank, sizes, store, path, prompt, name, results):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        from worker.parallel.state import ParallelState, set_parallel_state
        set_parallel_state(ParallelState(rank, *sizes))
        out = prompt_logits(path, prompt, quantization=name).tolist()
        if rank == 0:
            results.put(out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["tensor", "expert"])
def test_two_ranks_serve_quantized_moe_weights_as_one_process(hf_models, tmp_path, layout):
    """Tiny Mixtral, int4 by groups of 32: each rank quantizes only its own slices (whole
    experts; rows, or whole groups of columns), which are the one process's codes."""
    _, path = hf_models("mixtral")
    prompt = make_prompts([19], seed=7)[0]
    name = "int4-g32"
    one = prompt_logits(path, prompt, quantization=name)
    sizes = (WORLD, 1) if layout == "tensor" else (1, WORLD)
    out = run_ranks(_rank_main, lambda r, results: (r, sizes, str(tmp_path / "store"), str(path), prompt, name,
                                                     results))
    torch.testing.assert_close(torch.tensor(out), one, rtol=1e-4, atol=1e-4)


def test_a_method_file_registers_its_variants_and_a_name_is_taken_once(monkeypatch):
    """``--quantization NAME`` offers what the method files register: each of the four files'
    variants, and a new one the moment it registers; a second method under a taken name is refused."""
    from worker.quant import method
    assert method.method_names() == ["fp8", "fp8-block", "int4", "int4-g128", "int4-g32", "int8", "nvfp4"]
    monkeypatch.setattr(method, "_METHODS", dict(method._METHODS))
    monkeypatch.setattr(method, "_registry", lambda: method._METHODS)
    halves = method.QuantMethod("int8-halves", "a test's own", lambda w: None, 32)
    method.register(halves)
    assert "int8-halves" in method.method_names() and method.get_method("int8-halves") is halves
    with pytest.raises(ValueError, match="two quantization methods are named 'int8'"):
        method.register(method.QuantMethod("int8", "another", lambda w: None, 32))
