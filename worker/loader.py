# mypy: disable-error-code="arg-type"
"""Hugging Face directory -> a ready ``DecoderModel``.

Reads ``config.json`` and ``*.safetensors`` (one file, or shards listed in
``model.safetensors.index.json``) with ``safetensors``, never pickle. Tensors are
handed to the model's loaders one at a time as ``CheckpointTensor``s, which read
from the file only the slice a loader indexes: a rank of a worker group reads its
shard of each matrix, never another rank's experts or another stage's layers.

A directory holding one ``*.gguf`` file instead is read with llama.cpp's blocks kept as
they ship (``worker/quant/gguf.py``), and an FP8 safetensors checkpoint (compressed-tensors'
or ``quant_method: fp8``) with its codes and scales kept (``worker/quant/checkpoint.py``);
``quantization`` quantizes a float checkpoint's weights once they are loaded
(``worker/quant/model.py``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from worker.config import ConfigError, ModelConfig
from worker.layers.packing import pack_weights, packs_invariant
from worker.models.decoder import DecoderModel, load_weights
from worker.quant.checkpoint import IGNORED_SUFFIXES, SCALE_SUFFIXES, Fp8Tensor, fp8_block
from worker.quant.gguf import gguf_file, iter_gguf_tensors
from worker.quant.model import quantize_model, set_quantized


def safetensor_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        outside = [n for n in names if not _plain_file_name(n)]
        if outside:  # "../x", "/etc/x", "sub/x": a shard is a file of the model directory itself
            raise ConfigError(f"{index.name} names shards outside the model directory: {outside[:3]}")
        files = [model_dir / n for n in names]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ConfigError(f"shards listed in {index.name} are missing: {absent}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir}: no *.safetensors files (Kervan never loads pickled weights)")
    return files


def _plain_file_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name and "\\" not in name


class CheckpointTensor:
    """One tensor of a safetensors file, read only as far as it is indexed (``t[a:b]``,
    ``t[:, a:b]``, ``t[:]`` for all of it) and cast to the serving dtype as it is read.
    Valid while ``iter_tensors`` has not moved past it."""

    def __init__(self, name: str, view, dtype: torch.dtype | None):
        self.name = name
        self.shape = torch.Size(view.get_shape())
        self._view, self._dtype = view, dtype

    def dim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        t = self._view[index]
        return t if self._dtype is None else t.to(self._dtype)


def iter_tensors(model_dir: Path, dtype: torch.dtype,
                 fp8_block: int | None = None) -> Iterator[tuple[str, CheckpointTensor | Fp8Tensor]]:
    """Each tensor of the checkpoint; with ``fp8_block`` (an FP8 checkpoint's layout,
    ``worker/quant/checkpoint.py``) its float8 weights as ``Fp8Tensor``s with their scales,
    the scales themselves and the activations' not yielded."""
    files = safetensor_files(model_dir)
    scales: dict[str, torch.Tensor] = {}
    if fp8_block is not None:  # small, read whole first: a scale may sit in a later file than its weight
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                scales.update({n: f.get_tensor(n) for n in f.keys() if n.endswith(SCALE_SUFFIXES)})
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                view = f.get_slice(name)
                if fp8_block is not None:
                    if name.endswith(SCALE_SUFFIXES + IGNORED_SUFFIXES):
                        continue
                    if view.get_dtype() == "F8_E4M3":
                        scale = scales.get(f"{name}_scale", scales.get(f"{name}_scale_inv"))
                        if scale is None:
                            raise ConfigError(f"{path.name}: {name} is FP8 with no {name}_scale")
                        yield name, Fp8Tensor(name, view, scale, fp8_block)
                        continue
                # routing biases stay float32 (their small differences decide experts)
                yield name, CheckpointTensor(name, view, None if name.endswith("e_score_correction_bias") else dtype)


def load_model(model_dir: str | Path, dtype: torch.dtype, max_positions: int,
               device: str = "cpu", quantization: str | None = None) -> DecoderModel:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device(device):
        model = DecoderModel(cfg, dtype, max_positions)
    gguf = gguf_file(model_dir) if not any(model_dir.glob("*.safetensors")) else None
    block = fp8_block(json.loads((model_dir / "config.json").read_text())) if gguf is None else None
    if (gguf is not None or block is not None) and quantization is not None:
        raise ConfigError(f"{gguf.name if gguf else model_dir.name} is already quantized: serve it as it is, "
                          f"or a float checkpoint with quantization {quantization!r}")
    load_weights(model, iter_gguf_tensors(gguf, cfg, dtype) if gguf is not None
                 else iter_tensors(model_dir, dtype, block))
    if quantization is not None:
        quantize_model(model, quantization)
    _place_quantized(model, device)
    dense = [m for m in model.dense_linears() if m.quant is None]
    pack_weights(dense, dtype, torch.device(device).type)
    if packs_invariant(torch.device(device).type):
        for moe in model.moes:
            moe.pack()
    return model.eval()


def _place_quantized(model: DecoderModel, device: str) -> None:
    """A tied head shares its embedding's quantized rows; codes read on the CPU (GGUF's
    memory map) move to the model's device."""
    for module in model.modules():
        quant = getattr(module, "quant", None)
        if quant is not None and quant.codes.device != torch.device(device):
            module.quant = quant.to(device)
    head, embed = model.lm_head, model.embed
    if head is not None and embed is not None and model.cfg.tie_word_embeddings and embed.quant is not None:
        set_quantized(head, embed.quant)
