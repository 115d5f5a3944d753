"""A full-depth mixture of experts as a Q4_0 GGUF of random weights, for running Kervan and
llama.cpp on the same file: Qwen1.5-MoE-A2.7B's published shape (24 layers, hidden 2,048,
16 heads of 128 with q/k/v biases, 60 experts of 1,408 with 4 routed a token, a gated shared
expert of 5,632; 14.3B parameters, about 8 GB in Q4_0) with the 128,256-token vocabulary of the
tokenizer at hand (the 1B GGUF's, which llama.cpp needs inside the file; Qwen's own has 151,936
ids), written as llama.cpp's converter and ``llama-quantize --pure`` write ``qwen2moe``: every
matrix Q4_0 (experts stacked, ``ffn_*_exps``), norms, biases and routers float32.

The codes are random bytes and each block's scale a random float16 near 0.02 / 8, so a weight
has the spread of an initialised model's. Streamed to disk tensor by tensor (no 8 GB in memory),
once, into the cache beside ``config.json`` for Kervan.

    python -m benchmarks.gguf_moe --tokenizer-from /path/to/llama1b-q4_0.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from kervan.envs import cache_dir

Q4_0, F32 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.F32
SHAPE = dict(layers=24, hidden=2048, heads=16, head_dim=128, experts=60, top_k=4, expert_inter=1408,
             shared_inter=5632, rope_theta=1000000.0, eps=1e-6, context=8192)


def q4_0_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """[rows, cols / 32 * 18] bytes of Q4_0 blocks: a float16 scale, then 16 bytes of codes."""
    blocks = rows * cols // 32
    out = np.empty((blocks, 18), dtype=np.uint8)
    out[:, :2] = (rng.uniform(0.5, 1.5, blocks) * 0.02 / 8).astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
    return out.reshape(rows, -1)


def tensors(shape: dict, vocab: int):
    """(name, shape as PyTorch writes it, kind): the file's tensors in llama.cpp's order."""
    h, heads, d, e = shape["hidden"], shape["heads"], shape["head_dim"], shape["experts"]
    yield "token_embd.weight", (vocab, h), Q4_0
    for i in range(shape["layers"]):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (h,), F32
        for part in ("q", "k", "v"):
            yield b + f"attn_{part}.weight", (heads * d, h), Q4_0
            yield b + f"attn_{part}.bias", (heads * d,), F32
        yield b + "attn_output.weight", (h, heads * d), Q4_0
        yield b + "ffn_norm.weight", (h,), F32
        yield b + "ffn_gate_inp.weight", (e, h), F32
        yield b + "ffn_gate_exps.weight", (e, shape["expert_inter"], h), Q4_0
        yield b + "ffn_up_exps.weight", (e, shape["expert_inter"], h), Q4_0
        yield b + "ffn_down_exps.weight", (e, h, shape["expert_inter"]), Q4_0
        yield b + "ffn_gate_inp_shexp.weight", (h,), F32
        yield b + "ffn_gate_shexp.weight", (shape["shared_inter"], h), Q4_0
        yield b + "ffn_up_shexp.weight", (shape["shared_inter"], h), Q4_0
        yield b + "ffn_down_shexp.weight", (h, shape["shared_inter"]), Q4_0
    yield "output_norm.weight", (h,), F32
    yield "output.weight", (vocab, h), Q4_0


def data(rng: np.random.Generator, name: str, dims: tuple, kind) -> np.ndarray:
    if kind == Q4_0:
        rows = int(np.prod(dims[:-1]))
        return q4_0_blocks(rng, rows, dims[-1]).reshape(*dims[:-1], -1)
    if name.endswith("norm.weight"):
        return np.ones(dims, dtype=np.float32)
    return (rng.standard_normal(dims) * 0.02).astype(np.float32)


def copy_tokenizer(source: Path, writer: GGUFWriter) -> int:
    """The tokenizer's metadata from another GGUF; returns its vocabulary size."""
    reader = GGUFReader(str(source))
    vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            values = field.contents()
            writer.add_array(key, values)
            vocab = max(vocab, len(values)) if key == "tokenizer.ggml.tokens" else vocab
        elif kind == GGUFValueType.STRING:
            writer.add_string(key, field.contents())
        elif kind == GGUFValueType.UINT32:
            writer.add_uint32(key, int(field.contents()))
        elif kind == GGUFValueType.BOOL:
            writer.add_bool(key, bool(field.contents()))
    return vocab


def write(target: Path, tokenizer: Path, shape: dict, seed: int = 0) -> None:
    writer = GGUFWriter(str(target / f"qwen-moe-{shape['layers']}l-q4_0.gguf"), "qwen2moe")
    vocab = copy_tokenizer(tokenizer, writer)
    writer.add_name("random Qwen1.5-MoE-A2.7B shape")
    writer.add_context_length(shape["context"])
    writer.add_embedding_length(shape["hidden"])
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(shape["shared_inter"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["heads"])
    writer.add_rope_freq_base(shape["rope_theta"])
    writer.add_layer_norm_rms_eps(shape["eps"])
    writer.add_expert_count(shape["experts"])
    writer.add_expert_used_count(shape["top_k"])
    writer.add_expert_feed_forward_length(shape["expert_inter"])
    writer.add_expert_shared_feed_forward_length(shape["shared_inter"])
    writer.add_file_type(2)  # MOSTLY_Q4_0
    listed = list(tensors(shape, vocab))
    for name, dims, kind in listed:
        byte_shape = (*dims[:-1], dims[-1] // 32 * 18) if kind == Q4_0 else dims
        dtype = np.dtype(np.uint8) if kind == Q4_0 else np.dtype(np.float32)
        writer.add_tensor_info(name, byte_shape, dtype, int(np.prod(byte_shape)) * dtype.itemsize,
                               raw_dtype=kind if kind == Q4_0 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, kind in listed:
        writer.write_tensor_data(data(rng, name, dims, kind))
    writer.close()
    config = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": vocab,
              "hidden_size": shape["hidden"], "intermediate_size": shape["shared_inter"],
              "num_hidden_layers": shape["layers"], "num_attention_heads": shape["heads"],
              "num_key_value_heads": shape["heads"], "head_dim": shape["head_dim"], "num_experts": shape["experts"],
              "num_experts_per_tok": shape["top_k"], "moe_intermediate_size": shape["expert_inter"],
              "shared_expert_intermediate_size": shape["shared_inter"], "norm_topk_prob": False,
              "decoder_sparse_step": 1, "rope_theta": shape["rope_theta"], "rms_norm_eps": shape["eps"],
              "max_position_embeddings": shape["context"], "tie_word_embeddings": False, "qkv_bias": True}
    (target / "config.json").write_text(json.dumps(config, indent=2))


def ensure_gguf_moe(tokenizer: Path, layers: int = SHAPE["layers"]) -> Path:
    target = cache_dir() / f"kervan-bench-gguf-qwen-moe-{layers}l-q4_0"
    if any(target.glob("*.gguf")):
        return target
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=f".{target.name}-"))
    try:
        write(tmp, tokenizer, dict(SHAPE, layers=layers))
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer-from", required=True, help="a GGUF whose tokenizer the file takes")
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    args = ap.parse_args()
    print(ensure_gguf_moe(Path(args.tokenizer_from), args.layers))


if __name__ == "__main__":
    main()
