# mypy: disable-error-code="unreachable"
"""Vocabulary-parallel embedding and LM head: each rank owns a contiguous slice
of the vocabulary. Lookups of ids outside the slice give zeros and the ranks'
results are summed; the head's partial logits are gathered on the last dim.
Quantized (``quant``, from a GGUF file or ``worker/quant/model.py``), a lookup
dequantizes only the rows it reads."""

from __future__ import annotations

import torch
from torch import nn

from worker.layers.linear import check_shape
from worker.layers.packing import PackedLinear, packed_linear
from worker.parallel import all_gather_last_dim, all_reduce, get_parallel_state
from worker.quant.matmul import dequantize, quant_linear
from worker.quant.weight import QuantizedWeight


class VocabParallelEmbedding(nn.Module):
    quant: QuantizedWeight | None = None  # low-precision rows, in place of ``weight``

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.input_size = hidden_size  # the LM head's matmul input
        self.start, self.end = get_parallel_state().shard(vocab_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def load(self, tensor: torch.Tensor) -> None:
        check_shape(tensor, (self.vocab_size, self.input_size))
        rows = tensor[self.start:self.end]  # a tensor, or a QuantizedWeight (GGUF's blocks)
        if isinstance(rows, QuantizedWeight):
            self.quant = rows
            self.register_parameter("weight", None)
            return
        self.weight.data.copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_parallel_state().tp_size == 1:
            return self._lookup(ids)
        local = (ids >= self.start) & (ids < self.end)
        out = self._lookup((ids - self.start) * local)
        return all_reduce(out * local.unsqueeze(-1).to(out.dtype))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return nn.functional.embedding(ids, self.weight)
        return dequantize(self.quant.rows(ids.flatten()), self.dtype).view(*ids.shape, self.input_size)


class ParallelLMHead(VocabParallelEmbedding):
    keep_weight = False  # True when tied to the embedding, which still looks rows up in it
    packed: PackedLinear | None = None  # the loader's packed layout (``packing.pack_weights``)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return all_gather_last_dim(quant_linear(hidden, self.quant))
        return all_gather_last_dim(packed_linear(hidden, self.weight, self.packed, None))
