"""Batch-invariant matmuls: the deterministic mode's linear layers.

oneDNN and MKL choose a matmul's algorithm from its shape: how the reduction over
the input features is blocked and split among threads (and, at one row, a matrix-
vector kernel of its own) changes with the number of rows. So a token's output
row, and with it every later rounding, changes with whatever else is in the step:
the other sequences of a batch, how the prompt was chunked, whether its prefix came
from the cache. Measured here, a row's float32 result falls into 2-5 classes over
1-2,048 rows depending on the shape, and bf16 into 1-2.

One call shape, though, computes every row the same way, wherever it sits among the
rows and whatever the others hold (``tests/worker/test_deterministic.py`` holds the
kernels to it on every ISA level CI runs). So in deterministic mode a linear runs as
calls of ``ROW_TILE`` rows, the last one padded: a row's result depends on that row
alone. Calls of ``ROW_TILE`` rows each sweep the whole weight, which a long prompt
chunk pays many times over; so at load ``RowPlan.probe`` also tries calls of 2, 4,
... times ``ROW_TILE`` rows on this layer's own weights, filled with copies of one
``ROW_TILE`` call's rows, and keeps a size only when *every* row of it equals what
the ``ROW_TILE`` call gave that row, bit for bit, over enough random inputs that
another summation order would show (``_COMPARED``). Every call
the plan makes then computes each row exactly as a ``ROW_TILE`` call would: which
sizes a worker kept changes its speed, never its bits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# rows of the reference call, whose arithmetic every other call must reproduce; every process
# of a mesh must use the same (a constant, not a flag, for that reason)
ROW_TILE = 32

Linear = Callable[[torch.Tensor], torch.Tensor]  # [rows, in_features] -> [rows, out_features], row-wise


@dataclass(frozen=True)
class RowPlan:
    """The row counts a layer's matmul may be called with, largest first; each computes
    every row as a ``ROW_TILE`` call does (``ROW_TILE`` itself always qualifies)."""

    sizes: tuple[int, ...] = (ROW_TILE,)

    @staticmethod
    def probe(fn: Linear, in_features: int, dtype: torch.dtype, device: torch.device | str, max_rows: int,
              verdicts: dict[int, bool] | None = None) -> RowPlan:
        """The sizes up to ``max_rows`` whose calls of ``fn`` agree with ``ROW_TILE`` calls
        at every row position, over enough random inputs that another order of summation
        would show (``_COMPARED``). ``verdicts``: sizes already probed for this ``fn``'s
        shape (read and added to)."""
        verdicts = {} if verdicts is None else verdicts
        sizes = [ROW_TILE]
        size = 2 * ROW_TILE
        while size <= max_rows:
            if size not in verdicts:
                verdicts[size] = _agrees(fn, size, in_features, dtype, device, torch.Generator().manual_seed(size))
            if verdicts[size]:
                sizes.append(size)
            size *= 2
        return RowPlan(tuple(sorted(sizes, reverse=True)))

    def calls(self, rows: int) -> list[int]:
        """The call sizes for ``rows`` rows: the largest that fit, then the smallest that
        holds the rest (padded)."""
        out, left = [], rows
        for size in self.sizes:
            while left >= size:
                out.append(size)
                left -= size
        if left:
            out.append(min(s for s in self.sizes if s >= left))
        return out

    def run(self, fn: Linear, x: torch.Tensor) -> torch.Tensor:
        """``fn(x)`` computed through the plan's calls. x: [rows, in_features]."""
        rows = x.shape[0]
        if not rows:
            return fn(x)
        outs, start = [], 0
        for size in self.calls(rows):
            chunk = x[start:start + size]
            if chunk.shape[0] < size:  # the last call: its rows padded with zeros
                chunk = torch.cat((chunk, chunk.new_zeros(size - chunk.shape[0], chunk.shape[1])))
            outs.append(fn(chunk))
            start += size
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out[:rows]


def probed_plan(key: tuple, fn: Linear, in_features: int, dtype: torch.dtype, device: torch.device | str,
                max_rows: int) -> RowPlan:
    """``RowPlan.probe``, each call size probed once per process for each ``key`` (the
    weight's shape and layout): oneDNN picks its algorithm from those, not from the values,
    so every layer and every engine of one shape share the probe."""
    verdicts = _PROBED.setdefault((*key, in_features, dtype, str(device)), {})
    return RowPlan.probe(fn, in_features, dtype, device, max_rows, verdicts)


_PROBED: dict[tuple, dict[int, bool]] = {}  # probed_plan's verdicts by call size, for this process

# Output elements compared before a call size is trusted. Two summation orders differ in a
# float32 result's last bits, always visible in float32 output; rounded to 16 bits, they show
# only where the two sums straddle a rounding boundary (about 2^-15 of elements for sums a few
# float32 ulps apart), so a 16-bit probe must look at millions: at 2^22 elements such a pair
# agreeing everywhere by chance is below e^-100.
_COMPARED = {torch.float32: 1 << 16, torch.float64: 1 << 16}
_COMPARED_16_BIT = 1 << 22


def _agrees(fn: Linear, size: int, in_features: int, dtype: torch.dtype, device, g: torch.Generator) -> bool:
    """Calls of ``size`` rows, filled with copies of a ``ROW_TILE`` call's rows, give every
    row the bits that call gave it, on fresh random inputs until enough elements were seen."""
    seen, copies = 0, size // ROW_TILE
    while seen < _COMPARED.get(dtype, _COMPARED_16_BIT):
        tile = torch.randn(ROW_TILE, in_features, generator=g).to(dtype=dtype, device=device)
        want = fn(tile)
        if not torch.equal(fn(tile.repeat(copies, 1)), want.repeat(copies, 1)):
            return False
        seen += size * want.shape[1]
    return True
