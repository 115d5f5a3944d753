"""GGUF files served as they ship: llama.cpp's blocks repacked into ``QuantizedWeight``
by copying bytes, never through float.

Read through a memory map (``gguf_index``, with llama.cpp's ``gguf`` package's constants):
a rank reads only the rows, or the blocks of columns, its slice needs. Supported block types, per 32 weights:

- Q4_0: float16 ``d`` and 16 bytes of 4-bit codes; ``w = d * (q - 8)`` -> table -8..7, scale d;
- Q4_1: float16 ``d`` and ``m``, 16 bytes of codes; ``w = d * q + m`` -> codes 0..15, scale d, zero m;
- Q8_0: float16 ``d`` and 32 int8 codes; ``w = d * q`` -> int8 codes by groups of 32;
- F32, F16, BF16: plain tensors (norms).

llama.cpp's converter permutes the query and key rows of the models it writes as its
``llama`` architecture (Llama, Mistral, Mixtral: its rotary embedding pairs neighbouring
features, Hugging Face's pairs halves); the rows are put back in Hugging Face's order here,
as transformers' GGUF reader does, so the model and every slice of it see the layout of the
safetensors checkpoint. Its Qwen2 families are written unpermuted.

A mixture of experts stores each layer's experts stacked, ``ffn_{gate,up,down}_exps``
[experts, rows, columns] (and Qwen2-MoE's shared expert as ``ffn_*_shexp``); each expert's
slice is yielded under its Hugging Face name (``experts.E.gate_proj.weight``), so the layer
loads a GGUF's experts as it loads a safetensors checkpoint's, reading only its own."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from worker.config import MOE_NAMING, ConfigError, ModelConfig
from worker.quant.gguf_index import read_index
from worker.quant.weight import CodeFormat, QuantizedWeight

# GGUF name -> Hugging Face name ({} is the layer)
NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
    "blk.{}.attn_q.bias": "model.layers.{}.self_attn.q_proj.bias",
    "blk.{}.attn_k.bias": "model.layers.{}.self_attn.k_proj.bias",
    "blk.{}.attn_v.bias": "model.layers.{}.self_attn.v_proj.bias",
}
# a MoE layer's tensors: GGUF name -> the name under the layer's MoE prefix ({mlp}: ``mlp`` or
# ``block_sparse_moe``; {shared}: the shared expert's module), {e} an expert of a stacked tensor
MOE_NAMES = {
    "blk.{}.ffn_gate_inp.weight": "{mlp}.gate.weight",
    "blk.{}.ffn_gate_exps.weight": "{mlp}.experts.{e}.{gate}.weight",
    "blk.{}.ffn_up_exps.weight": "{mlp}.experts.{e}.{up}.weight",
    "blk.{}.ffn_down_exps.weight": "{mlp}.experts.{e}.{down}.weight",
    "blk.{}.ffn_gate_shexp.weight": "{mlp}.{shared}.gate_proj.weight",
    "blk.{}.ffn_up_shexp.weight": "{mlp}.{shared}.up_proj.weight",
    "blk.{}.ffn_down_shexp.weight": "{mlp}.{shared}.down_proj.weight",
    "blk.{}.ffn_gate_inp_shexp.weight": "{mlp}.shared_expert_gate.weight",
}
# the architectures llama.cpp writes as ``llama``, query and key rows permuted
PERMUTED = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # per 32 weights
Q4_0_VALUES = torch.arange(16, dtype=torch.float32) - 8
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def gguf_file(model_dir: Path) -> Path | None:
    files = sorted(model_dir.glob("*.gguf"))
    if len(files) > 1:
        raise ConfigError(f"{model_dir}: more than one .gguf file ({[f.name for f in files]})")
    return files[0] if files else None


def hf_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2:
        template = NAMES.get(".".join(["blk", "{}", *parts[2:]]))
        if template is not None:
            return template.format(parts[1])
    elif name in NAMES:
        return NAMES[name]
    raise ConfigError(f"GGUF tensor {name!r} has no counterpart in Kervan's Llama-family decoder")


def moe_names(name: str, cfg: ModelConfig) -> list[str] | None:
    """A MoE layer's tensor's Hugging Face names: one per expert for a stacked tensor, else
    one (None: not a MoE tensor)."""
    parts = name.split(".")
    template = MOE_NAMES.get(".".join(["blk", "{}", *parts[2:]])) if parts[0] == "blk" and len(parts) > 2 else None
    if template is None or cfg.moe is None:
        return None
    naming = MOE_NAMING[cfg.architecture]
    gate, up, down = naming.experts
    prefix = f"model.layers.{parts[1]}."
    fill = dict(mlp=naming.mlp, shared=naming.shared, gate=gate, up=up, down=down)
    if "{e}" not in template:
        return [prefix + template.format(**fill)]
    return [prefix + template.format(e=e, **fill) for e in range(cfg.moe.num_experts)]


class GgufTensor:
    """One GGUF tensor, read only as far as it is indexed (``t[a:b]`` rows, ``t[:, a:b]``
    columns in whole blocks, ``t[:]``): a ``QuantizedWeight`` for the block types, a tensor
    in ``dtype`` for the float ones."""

    def __init__(self, name: str, kind: str, data: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype,
                 row_order: torch.Tensor | None):
        self.name, self.kind, self._data, self._dtype, self._order = name, kind, data, dtype, row_order
        self.shape = torch.Size(shape)

    def dim(self) -> int:
        return len(self.shape)

    def expert(self, e: int) -> GgufTensor:
        """Expert e's matrix of a stacked [experts, rows, columns] tensor (its bytes only)."""
        experts, rows, cols = self.shape
        if self.kind in BLOCK_BYTES:  # [experts * rows, bytes a row]
            data = self._data.reshape(experts * rows, -1)[e * rows:(e + 1) * rows]
        else:  # float bytes, flat
            size = rows * cols * torch.empty((), dtype=FLOAT_TYPES[self.kind]).element_size()
            data = self._data[e * size:(e + 1) * size]
        return GgufTensor(self.name, self.kind, data, (rows, cols), self._dtype, None)

    def __getitem__(self, index) -> torch.Tensor | QuantizedWeight:
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        if self.kind in FLOAT_TYPES:
            t = torch.from_numpy(np.array(self._data)).view(FLOAT_TYPES[self.kind])
            t = t.view(self.shape) if self._order is None else t.view(self.shape)[self._order]
            return t[index].to(self._dtype)
        start, stop = cols.start or 0, self.shape[1] if cols.stop is None else cols.stop
        if start % 32 or stop % 32:
            raise ValueError(f"columns {start}:{stop} split a 32-weight GGUF block")
        block = BLOCK_BYTES[self.kind]
        picked = np.arange(self.shape[0])[rows] if self._order is None else self._order[rows].numpy()
        raw = np.ascontiguousarray(self._data[picked][:, start // 32 * block:stop // 32 * block])
        return repack(raw, self.kind, stop - start)


def repack(raw: np.ndarray, kind: str, in_features: int) -> QuantizedWeight:
    """GGUF blocks [rows, in / 32 * block bytes] -> a ``QuantizedWeight`` (bytes copied)."""
    rows = raw.shape[0]
    blocks = torch.from_numpy(raw).view(rows, in_features // 32, BLOCK_BYTES[kind])
    d = blocks[..., 0:2].contiguous().view(torch.float16).view(rows, -1)
    if kind == "Q8_0":
        return QuantizedWeight(blocks[..., 2:].reshape(rows, in_features).contiguous(), d, None, None,
                               CodeFormat.INT8, 32, in_features, method="gguf-q8_0")
    if kind == "Q4_0":
        return QuantizedWeight(blocks[..., 2:].reshape(rows, in_features // 2).contiguous(), d, None,
                               Q4_0_VALUES.clone(), CodeFormat.LUT4, 32, in_features, method="gguf-q4_0")
    m = blocks[..., 2:4].contiguous().view(torch.float16).view(rows, -1)
    return QuantizedWeight(blocks[..., 4:].reshape(rows, in_features // 2).contiguous(), d, m, None,
                           CodeFormat.UINT4, 32, in_features, method="gguf-q4_1")


def check_rope_freqs(path: Path, factors: np.ndarray, cfg: ModelConfig) -> None:
    """llama.cpp stores Llama 3's rope scaling as a factor per frequency (``rope_freqs``: each
    base frequency is divided by its factor); Kervan computes the same from ``config.json``'s
    ``rope_scaling``, so the tensor is read only to check the two agree."""
    from worker.layers.rotary import inverse_frequencies  # the layer the model uses

    scaled = inverse_frequencies(cfg.rope)
    base = inverse_frequencies(replace(cfg.rope, scaling_type="default"))
    got = torch.from_numpy(np.array(factors)).view(torch.float32)
    if got.shape != base.shape or not torch.allclose(got, base / scaled, rtol=1e-3):
        raise ConfigError(f"{path.name}: its rope_freqs (Llama 3 rope scaling) disagree with config.json's rope "
                          f"scaling ({cfg.rope.scaling_type}, factor {cfg.rope.factor}): serve it with the config "
                          "it was converted from")


def iter_gguf_tensors(path: Path, cfg: ModelConfig, dtype: torch.dtype) -> Iterator[tuple[str, GgufTensor]]:
    for t in read_index(path):
        if t.name == "rope_freqs.weight" and t.kind == "F32":
            check_rope_freqs(path, t.data, cfg)
            continue
        if t.kind not in BLOCK_BYTES and t.kind not in FLOAT_TYPES:
            raise ConfigError(f"{path.name}: tensor {t.name} is {t.kind}; Kervan reads GGUF's "
                              f"{', '.join([*BLOCK_BYTES, *FLOAT_TYPES])}")
        names = moe_names(t.name, cfg)
        if names is not None:
            tensor = GgufTensor(names[0], t.kind, t.data, t.shape, dtype, None)
            if len(names) > 1:  # stacked experts
                if len(t.shape) != 3 or t.shape[0] != len(names):
                    raise ConfigError(f"{path.name}: {t.name} is {list(t.shape)}, not [{len(names)} experts, "
                                      "rows, columns]")
                yield from ((name, tensor.expert(e)) for e, name in enumerate(names))
            elif t.name.endswith("ffn_gate_inp_shexp.weight"):  # [hidden] in GGUF, [1, hidden] in the model
                yield names[0], GgufTensor(names[0], t.kind, t.data, (1, *t.shape), dtype, None)
            else:
                yield names[0], tensor
            continue
        name = hf_name(t.name)
        order = None
        if name.endswith(("q_proj.weight", "k_proj.weight")) and cfg.architecture in PERMUTED:
            heads = cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads
            order = unpermuted_rows(t.shape[0], heads)
        yield name, GgufTensor(name, t.kind, t.data, t.shape, dtype, order)


def unpermuted_rows(rows: int, heads: int) -> torch.Tensor:
    """Which GGUF row each Hugging Face row of a query or key matrix is (the inverse of
    llama.cpp's ``permute``: within a head, rows 2i and 2i+1 came from i and i + half)."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)
