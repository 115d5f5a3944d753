"""Pre-quantized FP8 safetensors checkpoints (``worker/quant/checkpoint.py``): written here
from a tiny random model in the layouts vLLM reads (compressed-tensors per channel and per
tensor, ``quant_method: fp8`` with block scales), loaded with their codes and scales kept,
and computed as the model given those weights dequantized."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.conftest import make_prompts
from tests.worker.test_model_parity import model_logits
from tests.worker.test_quantization import _dequantize_in_place
from worker.config import ConfigError
from worker.loader import load_model
from worker.quant.checkpoint import Fp8Tensor
from worker.quant.fp8 import quantize_fp8
from worker.quant.weight import CodeFormat

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def fp8_config(layout: str, block: int) -> dict:
    if layout == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block, block]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": layout, "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
            "ignore": ["lm_head"]}


def quantize(w: torch.Tensor, layout: str, block: int) -> dict[str, torch.Tensor]:
    """One weight as the layout stores it: e4m3 codes and their scale tensor."""
    if layout == "channel":
        q = quantize_fp8(w)
        return {"weight": q.codes.view(torch.float8_e4m3fn), "weight_scale": q.scales.float()}
    if layout == "tensor":
        scale = w.abs().amax() / E4M3_MAX
        return {"weight": (w / scale).to(torch.float8_e4m3fn), "weight_scale": scale.reshape(1)}
    out, size = w.shape
    tiles = w.reshape(out // block, block, size // block, block)
    scale = tiles.abs().amax(dim=(1, 3)) / E4M3_MAX
    codes = (tiles / scale[:, None, :, None]).reshape(out, size).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale_inv": scale}


def write_fp8(src, dst, layout: str, block: int = 32):
    """``src``'s decoder linears in an FP8 layout; everything else as it was."""
    shutil.copytree(src, dst)
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            stem = name[:-len("weight")]
            tensors.update({stem + k: v.contiguous() for k, v in quantize(t.float(), layout, block).items()})
            if layout != "block":
                tensors[stem + "input_scale"] = torch.ones(1)  # a static activation scale Kervan leaves unused
        else:
            tensors[name] = t
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = fp8_config(layout, block)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("layout", ["channel", "tensor", "block"])
def test_an_fp8_checkpoint_is_served_in_its_codes_as_its_dequantized_weights(hf_models, tmp_path, layout):
    _, path = hf_models("llama")
    fp8 = write_fp8(path, tmp_path / layout, layout)
    model = load_model(fp8, torch.float32, 512)
    layer = model.layers[0]
    for linear in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down):
        assert linear.quant is not None and linear.quant.format == CodeFormat.E4M3 and linear.weight is None
    assert model.lm_head.quant is None  # the checkpoint's float head stays float
    prompt = make_prompts([23], seed=5)[0]
    got = model_logits(model, prompt)
    _dequantize_in_place(model)
    torch.testing.assert_close(got, model_logits(model, prompt), rtol=1e-4, atol=1e-4)


def test_a_per_channel_checkpoint_holds_what_quantizing_at_load_makes(hf_models, tmp_path):
    """compressed-tensors' FP8 per channel and ``--quantization fp8`` are one format: the
    decoder's linears get the same codes and scales (``--quantization`` also makes the LM
    head int8; the checkpoint's head is float)."""
    _, path = hf_models("llama")
    read = load_model(write_fp8(path, tmp_path / "fp8", "channel"), torch.float32, 512)
    made = load_model(path, torch.float32, 512, quantization="fp8")
    for a, b in zip(read.dense_linears(), made.dense_linears()):
        if a is read.lm_head:
            continue
        assert torch.equal(a.quant.codes, b.quant.codes) and torch.equal(a.quant.scales, b.quant.scales)
        assert a.quant.group == b.quant.group


def test_other_quantized_checkpoints_and_requantizing_are_config_errors(hf_models, tmp_path):
    _, path = hf_models("llama")
    fp8 = write_fp8(path, tmp_path / "fp8", "channel")
    with pytest.raises(ConfigError, match="already quantized"):
        load_model(fp8, torch.float32, 512, quantization="int4")
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"]["format"] = "pack-quantized"  # compressed-tensors' int4
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="float-quantized"):
        load_model(fp8, torch.float32, 512)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="gptq"):
        load_model(fp8, torch.float32, 512)


def test_slices_the_kernel_cannot_take_and_pre_quantized_experts_are_config_errors(tmp_path):
    """A rank's slice of 48 columns (a tensor-parallel split of 96), a slice across a block,
    and an expert's weights: refused at load, never a failure inside the kernel."""
    codes = torch.zeros(64, 96).to(torch.float8_e4m3fn)
    save_file({"w": codes, "layers.0.mlp.experts.0.w1.weight": codes.clone()}, str(tmp_path / "t.safetensors"))
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as f:
        channel = Fp8Tensor("w", f.get_slice("w"), torch.ones(64, 1), 0)
        assert channel[:, 32:64].in_features == 32
        with pytest.raises(ConfigError, match="multiples of 32"):
            channel[:, 0:48]
        blocks = Fp8Tensor("w", f.get_slice("w"), torch.ones(2, 3), 32)
        assert blocks[:, 32:96].scales.shape == (64, 2)
        with pytest.raises(ConfigError, match="whole 64-wide FP8 blocks"):
            Fp8Tensor("w", f.get_slice("w"), torch.ones(1, 1), 64)[:, 0:32]
        with pytest.raises(ConfigError, match="pre-quantized experts"):
            Fp8Tensor("layers.0.mlp.experts.0.w1.weight", f.get_slice("layers.0.mlp.experts.0.w1.weight"),
                      torch.ones(1), 0)
