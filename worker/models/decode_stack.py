# mypy: disable-error-code="arg-type,attr-defined,list-item,return-value,union-attr,unreachable"
"""A decode step's decoder layers as one native call (``worker/kernels/decode_stack.cpp``):
the CPU's counterpart of replaying a CUDA graph.

A 30-layer model like SmolLM2-135M calls about ten kernels a layer; at batch 1 each
layer's kernels take ~100 us and the Python around them (module calls, views, the
dispatcher) another ~40 us. The stack holds each layer's weights and KV cache once, and
runs the same kernels in the same order from C++, so it computes bit for bit what
``DecoderModel``'s modules compute (``tests/worker/test_decode_stack.py``).

It serves a step when every row is a decode row (no prompt chunk), on the CPU with the
native kernels, on one process (no tensor or pipeline parallel: a collective between the
kernels), for dense layers (no MoE). Each linear takes the one kernel its module takes for
every call (``worker/layers/packing.py``, ``worker/quant/matmul.py``), so a step's rows come
out as the modules would give them, at any batch size.
``KERVAN_DECODE_STACK=off`` keeps the modules (the reference, and the benchmark's baseline)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from kervan.envs import decode_stack as decode_stack_mode
from worker.layers.linear import RowParallelLinear
from worker.layers.mlp import SwiGLU
from worker.layers.packing import PackKind
from worker.layers.paged_attention import padded_tables
from worker.parallel import get_parallel_state
from worker.parallel.step_inputs import StepInputs

log = logging.getLogger(__name__)

# the kernel each linear takes (decode_stack.cpp's ``Kind``)
INT8, QUANT, BRGEMM, ONEDNN, PLAIN, INVARIANT = range(6)
KIND_OF_PACK = {PackKind.BRGEMM: BRGEMM, PackKind.INVARIANT: INVARIANT, PackKind.ONEDNN: ONEDNN}


class DecodeStack:
    def __init__(self, native: torch.ScriptObject):
        self.native = native

    @staticmethod
    def serves(step: StepInputs) -> bool:
        """Whether ``step`` (on the CPU, native kernels) runs here: decode rows only."""
        return bool(step.token_ids) and not step.prefills

    def run(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final norm's hidden states [rows, hidden] and the logits of ``step.logit_rows``
        (None when no row samples): the embedding, every layer and the head in one call."""
        rows = len(step.token_ids)
        # one tensor for the step's integers, then views: a cold interpreter pays each torch.tensor
        flat = torch.tensor(step.token_ids + step.positions + step.slots + step.decode_lens + step.logit_rows)
        ids, positions, slots, lens, logit_rows = flat.split([rows, rows, rows, rows, len(step.logit_rows)])
        tables = padded_tables(step.decode_tables)
        in_order = len(step.logit_rows) == rows and step.logit_rows == list(range(rows))
        hidden, logits = self.native.step(ids, positions, slots, tables, lens, None if in_order else logit_rows)
        return hidden, logits if step.logit_rows else None


def build_decode_stack(model, kv_caches: list[torch.Tensor]) -> DecodeStack | None:
    """The stack for ``model`` (a ``DecoderModel``) and its caches, or None where it does not
    apply (see the module's docstring)."""
    dense = all(isinstance(layer.mlp, SwiGLU) for layer in model.layers)
    if (decode_stack_mode() == "off" or get_parallel_state().world != 1 or not dense or model.cfg.mla
            or model.norm is None or model.embed is None):
        return None
    first = model.layers[0].attn
    cfg = model.cfg
    native = torch.classes.kervan.DecodeStack(first.num_heads, first.num_kv_heads, first.head_dim, first.scale,
                                              cfg.rms_norm_eps, first.rotary.cos, first.rotary.sin, model.norm.weight)
    for layer, cache in zip(model.layers, kv_caches):
        if cache.device.type != "cpu":
            return None
        indices = []
        for module in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down):
            spec = linear_spec(module)
            if spec is None:
                return None
            indices.append(native.add_linear(*spec, module.bias))
        native.add_layer(layer.input_norm.weight, layer.post_attn_norm.weight, cache, *indices)
    head, embed = model.lm_head, model.embed
    spec = linear_spec(head)
    if spec is None or embed.dtype != model.norm.weight.dtype:
        return None
    native.set_ends(*embedding_spec(embed), native.add_linear(*spec, None))
    log.info("decode steps run as one native call over %d layers", len(model.layers))
    return DecodeStack(native)


def embedding_spec(embed: nn.Module) -> tuple[list, list[int], float]:
    """(tensors, ints, tensor_scale) of the embedding's table for ``DecodeStack.set_ends``."""
    q = embed.quant
    if q is None:
        return [embed.weight], [], 0.0
    return [q.codes, q.scales, q.zeros, q.lut], [int(q.format), q.group], q.tensor_scale


def linear_spec(module: nn.Module) -> tuple[int, list, list[int], float] | None:
    """(kind, tensors, ints, real) of the kernel ``layers/linear.py`` gives this module; None
    where the stack cannot take it (a row-parallel bias, which the modules add after the
    all-reduce)."""
    if isinstance(module, RowParallelLinear) and module.bias is not None:
        return None
    q = module.quant
    if q is not None:
        if q.int8 is not None:
            p = q.int8
            return INT8, [p.data], [q.out_features, q.group, int(p.four_bit), int(p.signed_codes),
                                    int(p.half_params), p.terms], 0.0
        return QUANT, [q.codes, q.scales, q.zeros, q.lut], [int(q.format), q.group], q.tensor_scale
    packed = module.packed
    if packed is None:
        return PLAIN, [module.weight], [], 0.0
    ints = [packed.out_features] if packed.kind == PackKind.INVARIANT else []
    return KIND_OF_PACK[packed.kind], [packed.data], ints, 0.0
