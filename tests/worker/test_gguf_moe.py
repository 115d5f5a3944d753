"""Mixtures of experts as llama.cpp writes them to GGUF: each layer's experts stacked
(``ffn_{gate,up,down}_exps`` [experts, rows, columns]), Qwen2-MoE's shared expert and its gate
(``ffn_*_shexp``, ``ffn_gate_inp_shexp`` [hidden]), query and key rows permuted for the
``llama`` architecture (Mixtral) and not for ``qwen2moe``, the router in float32. A tiny
transformers model's weights are quantized by llama.cpp's own ``gguf`` package (Q4_0 and
Q8_0, mixed as llama.cpp's files mix them) and written so; transformers then runs the same
weights dequantized, and Kervan serving the file gives its tokens and logits, the experts in
their 4- and 8-bit blocks through the fused int8-activation kernel."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from tests.conftest import build_hf_model, hf_greedy, make_engine, make_prompts
from worker import SamplingParams
from worker.kernels import has_native_kernels
from worker.loader import load_model

from .test_model_parity import model_logits

Q4_0, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0
ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe"}
# GGUF name (blk.{} for each layer) -> Hugging Face name under model.layers.N., and its blocks
LAYER = {
    "attn_norm.weight": ("input_layernorm.weight", None),
    "ffn_norm.weight": ("post_attention_layernorm.weight", None),
    "attn_q.weight": ("self_attn.q_proj.weight", Q4_0),
    "attn_k.weight": ("self_attn.k_proj.weight", Q4_0),
    "attn_v.weight": ("self_attn.v_proj.weight", Q4_0),
    "attn_output.weight": ("self_attn.o_proj.weight", Q4_0),
}
QWEN_LAYER = {
    "attn_q.bias": ("self_attn.q_proj.bias", None),
    "attn_k.bias": ("self_attn.k_proj.bias", None),
    "attn_v.bias": ("self_attn.v_proj.bias", None),
    "ffn_gate_shexp.weight": ("mlp.shared_expert.gate_proj.weight", Q4_0),
    "ffn_up_shexp.weight": ("mlp.shared_expert.up_proj.weight", Q4_0),
    "ffn_down_shexp.weight": ("mlp.shared_expert.down_proj.weight", None),  # 48 columns: no whole blocks
    "ffn_gate_inp_shexp.weight": ("mlp.shared_expert_gate.weight", None),
}


def llama_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's ``permute`` of query and key rows (pairs halves -> neighbours)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf(hf, kind: str, out_dir):
    """``hf``'s weights quantized into ``out_dir/model.gguf`` (and its config.json); ``hf`` then
    holds the same weights dequantized, the reference's."""
    cfg, sd = hf.config, hf.state_dict()
    writer = GGUFWriter(str(out_dir / "model.gguf"), ARCH[kind])
    writer.add_block_count(cfg.num_hidden_layers)

    def blocks(name: str | torch.Tensor, qtype) -> np.ndarray:
        """A tensor's (or a view's) GGUF bytes, or float32 values; the model keeps what they
        dequantize to."""
        tensor = sd[name] if isinstance(name, str) else name
        values = tensor.float().numpy()
        if qtype is None:
            return values
        q = quantize(values, qtype)
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(dequantize(q, qtype).reshape(values.shape)))
        return q

    def add(gguf_name: str, data: np.ndarray, qtype) -> None:
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)

    add("token_embd.weight", blocks("model.embed_tokens.weight", Q8_0), Q8_0)
    add("output_norm.weight", blocks("model.norm.weight", None), None)
    add("output.weight", blocks("lm_head.weight", Q8_0), Q8_0)
    heads = {"attn_q.weight": cfg.num_attention_heads, "attn_k.weight": cfg.num_key_value_heads}
    layer = LAYER | {"ffn_gate_inp.weight": ("mlp.gate.weight", None)} | (QWEN_LAYER if kind == "qwen2_moe" else {})
    experts, _, inter = hf.model.layers[0].mlp.experts.down_proj.shape
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for gguf_name, (hf_name, qtype) in layer.items():
            data = blocks(p + hf_name, qtype)
            if gguf_name in heads and ARCH[kind] == "llama":
                data = llama_permute(data, heads[gguf_name])
            if gguf_name == "ffn_gate_inp_shexp.weight":
                data = data.reshape(-1)  # [hidden] in GGUF
            add(f"blk.{i}.{gguf_name}", data, qtype)
        # transformers holds a layer's experts stacked: gate_up_proj [experts, 2 * inter, hidden] (gate rows
        # first) and down_proj [experts, hidden, inter]
        gate_up, down = sd[f"{p}mlp.experts.gate_up_proj"], sd[f"{p}mlp.experts.down_proj"]
        parts = {"gate": (gate_up[:, :inter], Q4_0), "up": (gate_up[:, inter:], Q4_0),
                 "down": (down, Q8_0)}  # llama.cpp's mixes differ by part
        for part, (stack, qtype) in parts.items():
            add(f"blk.{i}.ffn_{part}_exps.weight", np.stack([blocks(stack[e], qtype) for e in range(experts)]), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg.to_json_file(str(out_dir / "config.json"))
    hf.load_state_dict(sd)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def gguf_moe(request, tmp_path_factory):
    hf = build_hf_model(request.param)
    out = tmp_path_factory.mktemp(f"gguf-{request.param}")
    write_gguf(hf, request.param, out)
    return hf, out


@pytest.mark.skipif(not has_native_kernels(), reason="the native kernels are not built")
def test_a_gguf_moe_serves_its_quantized_experts_through_the_fused_kernel(gguf_moe):
    hf, path = gguf_moe
    model = load_model(path, torch.float32, 512)
    moe = model.moes[0]
    assert moe.expert_quants is not None and moe.w13 is None  # the blocks as they ship, no float copy
    prompt = make_prompts([29])[0]
    from worker.quant.kernel_choice import choose_kernels
    assert all(m.fused() is None for m in model.moes)  # the blocks as read: no layout for the fused call yet
    choose_kernels(model)  # as the engine's runner does: the int8-activation layout
    assert all(m.fused() is not None for m in model.moes)  # made again for the packed experts
    # each expert held once: its packed copy, its codes dropped
    assert all(q.int8 is not None and q.codes.numel() == 0 for m in model.moes for pair in m.expert_quants
               for q in pair)
    ours = model_logits(model, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    # the only difference left: x rounded to two int8 terms by blocks of 32 in each matmul
    torch.testing.assert_close(ours, ref, rtol=2e-2, atol=2e-2)


def test_a_gguf_moe_answers_as_transformers_on_its_weights(gguf_moe):
    hf, path = gguf_moe
    engine = make_engine(path)
    prompts = make_prompts([6, 17], seed=3)
    outs = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10)
