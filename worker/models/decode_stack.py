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
kernels), for dense layers (no MoE), outside deterministic mode (its row plans split
calls), and when no linear would take another kernel for that many rows than the one the
stack was given (``max_rows``; the int8 kernel's limit is ``matmul.int8_max_rows()``).
``KERVAN_DECODE_STACK=off`` keeps the modules (the reference, and the benchmark's baseline)."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from kervan.envs import decode_stack as decode_stack_mode
from worker.layers.linear import RowParallelLinear
from worker.layers.mlp import SwiGLU
from worker.layers.packing import BRGEMM_MAX_ROWS, GEMV_MAX_ROWS
from worker.layers.paged_attention import padded_tables
from worker.parallel import get_parallel_state
from worker.parallel.step_inputs import StepInputs
from worker.quant.matmul import DIRECT_MAX_ROWS, int8_max_rows

log = logging.getLogger(__name__)

# the kernel each linear takes (decode_stack.cpp's ``Kind``)
INT8, QUANT, BRGEMM, ONEDNN, PLAIN = range(5)


class DecodeStack:
    def __init__(self, native: torch.ScriptObject, max_rows: float, uses_int8: bool, head_rows: float,
                 head_int8: bool):
        self.native = native
        self.max_rows = max_rows  # the rows every linear's kernel serves, the int8 kernel's aside
        self.uses_int8 = uses_int8
        self.head_rows, self.head_int8 = head_rows, head_int8  # the same of the LM head's logit rows

    def serves(self, step: StepInputs) -> bool:
        """Whether ``step`` (on the CPU, native kernels) runs here: decode rows only, each
        linear's kernel the one the modules would call for that many rows."""
        rows, logit_rows = len(step.token_ids), len(step.logit_rows)
        if step.prefills or not rows or rows > self.max_rows or logit_rows > self.head_rows:
            return False
        return (not self.uses_int8 or rows <= int8_max_rows()) and (not self.head_int8 or logit_rows <= int8_max_rows())

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


def build_decode_stack(model, kv_caches: list[torch.Tensor], deterministic: bool) -> DecodeStack | None:
    """The stack for ``model`` (a ``DecoderModel``) and its caches, or None where it does not
    apply (see the module's docstring)."""
    dense = all(isinstance(layer.mlp, SwiGLU) for layer in model.layers)
    if (decode_stack_mode() == "off" or deterministic or get_parallel_state().world != 1 or not dense
            or model.norm is None or model.embed is None):
        return None
    first = model.layers[0].attn
    cfg = model.cfg
    native = torch.classes.kervan.DecodeStack(first.num_heads, first.num_kv_heads, first.head_dim, first.scale,
                                              cfg.rms_norm_eps, first.rotary.cos, first.rotary.sin, model.norm.weight)
    max_rows, uses_int8 = math.inf, False
    for layer, cache in zip(model.layers, kv_caches):
        if cache.device.type != "cpu":
            return None
        indices = []
        for module in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down):
            spec = linear_spec(module)
            if spec is None:
                return None
            kind, tensors, ints, real, rows = spec
            max_rows = min(max_rows, rows)
            uses_int8 |= kind == INT8
            indices.append(native.add_linear(kind, tensors, ints, real, module.bias, module.gemv_weight, GEMV_MAX_ROWS))
        native.add_layer(layer.input_norm.weight, layer.post_attn_norm.weight, cache, *indices)
    head, embed = model.lm_head, model.embed
    spec = linear_spec(head)
    if spec is None or embed.dtype != model.norm.weight.dtype:
        return None
    head_kind, tensors, ints, real, head_rows = spec
    native.set_ends(*embedding_spec(embed), native.add_linear(head_kind, tensors, ints, real, None, head.gemv_weight,
                                                              GEMV_MAX_ROWS))
    log.info("decode steps of up to %s rows run as one native call over %d layers", max_rows, len(model.layers))
    return DecodeStack(native, max_rows, uses_int8, head_rows, head_kind == INT8)


def embedding_spec(embed: nn.Module) -> tuple[list, list[int], float]:
    """(tensors, ints, tensor_scale) of the embedding's table for ``DecodeStack.set_ends``."""
    q = embed.quant
    if q is None:
        return [embed.weight], [], 0.0
    return [q.codes, q.scales, q.zeros, q.lut], [int(q.format), q.group], q.tensor_scale


def linear_spec(module: nn.Module) -> tuple[int, list, list[int], float, float] | None:
    """(kind, tensors, ints, real, the most rows it serves) of the kernel ``layers/linear.py``
    gives this module's decode rows (calls of up to ``GEMV_MAX_ROWS`` rows take the module's
    ``gemv_weight`` where it has one); None where the stack cannot take it (row plans; a
    row-parallel bias, which the modules add after the all-reduce)."""
    if module.row_plan is not None or (isinstance(module, RowParallelLinear) and module.bias is not None):
        return None
    q = module.quant
    if q is not None:
        if q.int8 is not None:
            p = q.int8
            ints = [q.out_features, q.group, int(p.four_bit), int(p.signed_codes), int(p.half_params), p.terms]
            return INT8, [p.data], ints, 0.0, math.inf  # the int8 kernel's rows: ``int8_max_rows()``
        return QUANT, [q.codes, q.scales, q.zeros, q.lut], [int(q.format), q.group], q.tensor_scale, DIRECT_MAX_ROWS
    if module.brgemm_weight is not None:
        return BRGEMM, [module.brgemm_weight], [], 0.0, BRGEMM_MAX_ROWS
    if module.packed_weight is not None:
        return ONEDNN, [module.packed_weight], [], 0.0, math.inf
    return PLAIN, [module.weight], [], 0.0, math.inf
