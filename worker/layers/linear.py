# mypy: disable-error-code="arg-type,assignment,union-attr,unreachable"
"""Tensor-parallel linears.

Column-parallel: the output dimension is split across ranks, no communication.
Row-parallel: the input dimension is split, partial products are all-reduced.
A merged column-parallel linear stacks several logical outputs (q/k/v, or gate/up)
in one matmul; each logical part is sharded on its own, so rank r holds
``[q_r; k_r; v_r]``; parts made of heads (``head_dim``) are split by whole heads,
and KV heads fewer than the ranks are replicated (``ParallelState.shard_heads``).
Each layer's ``load`` indexes its rank's slice of a checkpoint tensor, and only that
slice is read from the file (``worker/loader.py``). On the CPU the loader replaces ``weight`` by
``packed``, the layout of the kernel every call takes (``worker/layers/packing.py``: by default one
that computes each row alike at every row count).

A quantized layer holds ``quant`` (``worker/quant/weight.py``) instead of ``weight``:
filled from a pre-quantized checkpoint, whose tensors ``load`` slices as it slices float
ones (rows, or whole groups of columns), or made from the float weight after loading
(``worker/quant/model.py``)."""

from __future__ import annotations

import torch
from torch import nn

from worker.layers.packing import PackedLinear, packed_linear
from worker.parallel import all_reduce, get_parallel_state
from worker.quant.matmul import quant_linear
from worker.quant.weight import QuantizedWeight, cat_rows


class MergedColumnParallelLinear(nn.Module):
    packed: PackedLinear | None = None  # the loader's packed layout (``packing.pack_weights``)
    quant: QuantizedWeight | None = None  # low-precision weights, in place of ``weight``

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype, head_dim: int = 0):
        """``head_dim``: the parts are heads of this size (0: plain features)."""
        super().__init__()
        self.out_sizes = list(out_sizes)
        self.head_dim = head_dim
        self.input_size = in_features
        self.dtype = dtype  # of activations, and of ``weight`` unless quantized
        self.local_sizes = [end - start for start, end in map(self._shard, out_sizes)]
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(sum(self.local_sizes), dtype=dtype), requires_grad=False)
                     if bias else None)

    def load(self, part: int, tensor: torch.Tensor) -> None:
        """Copy this rank's slice of logical output ``part`` from a whole tensor."""
        start, end = self._shard(self.out_sizes[part])
        offset = sum(self.local_sizes[:part])
        if tensor.dim() == 2 and self.weight is None:  # quantized parts come in
            check_shape(tensor, (self.out_sizes[part], self.input_size))
            self._load_quantized(part, tensor[start:end])
            return
        target = self.bias if tensor.dim() == 1 else self.weight
        if target is None:
            raise ValueError("checkpoint has a bias but the layer has none")
        expected = (self.out_sizes[part],) + tuple(target.shape[1:])
        check_shape(tensor, expected)
        rows = tensor[start:end]  # a tensor, or a QuantizedWeight (GGUF's blocks)
        if isinstance(rows, QuantizedWeight):
            self._load_quantized(part, rows)
            return
        if target is self.weight:
            self._float_parts = getattr(self, "_float_parts", set()) | {part}
        target.data[offset:offset + end - start].copy_(rows)

    def _load_quantized(self, part: int, quant: QuantizedWeight) -> None:
        """A pre-quantized part; once every part is in, they become one matrix."""
        if not isinstance(quant, QuantizedWeight) or getattr(self, "_float_parts", None):
            raise ValueError("the parts of a merged linear mix float and quantized tensors; Kervan stacks them "
                             "into one matmul and needs them alike")
        self._parts = getattr(self, "_parts", {})
        self._parts[part] = quant
        self.register_parameter("weight", None)
        if len(self._parts) == len(self.out_sizes):
            self.quant = cat_rows([self._parts[p] for p in range(len(self.out_sizes))])
            del self._parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self, self.bias)

    def _shard(self, size: int) -> tuple[int, int]:
        ps = get_parallel_state()
        if self.head_dim:
            return ps.shard_heads(size // self.head_dim, self.head_dim, "heads")
        return ps.shard(size, "output features")


class RowParallelLinear(nn.Module):
    packed: PackedLinear | None = None
    quant: QuantizedWeight | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        start, end = get_parallel_state().shard(in_features, "input features")
        self.input_size = end - start  # this rank's
        self.dtype = dtype
        self.weight = nn.Parameter(torch.empty(out_features, end - start, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def load(self, tensor: torch.Tensor) -> None:
        if tensor.dim() == 1:
            check_shape(tensor, tuple(self.bias.shape))
            self.bias.data.copy_(tensor[:])
            return
        out_features = (self.weight if self.weight is not None else self.quant).shape[0]
        check_shape(tensor, (out_features, self.in_features))
        start, end = get_parallel_state().shard(self.in_features, "input features")
        cols = tensor[:, start:end]  # a tensor, or a QuantizedWeight (GGUF's blocks)
        if isinstance(cols, QuantizedWeight):
            self.quant = cols
            self.register_parameter("weight", None)
            return
        self.weight.data.copy_(cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(_linear(x, self, None))
        return out if self.bias is None else out + self.bias


def check_shape(tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"shape {tuple(tensor.shape)} does not match the expected {tuple(expected)}")


def copy_checked(target: torch.Tensor, tensor: torch.Tensor) -> None:
    check_shape(tensor, tuple(target.shape))
    target.copy_(tensor[:])  # all of a checkpoint tensor (``CheckpointTensor``) or a tensor


def _linear(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    if layer.quant is not None:
        return quant_linear(x, layer.quant, bias)
    return packed_linear(x, layer.weight, layer.packed, bias)
