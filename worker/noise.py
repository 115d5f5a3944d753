"""The random draws behind sampling: Exponential(1) noise per vocabulary entry, from a
request's own generator. Here, below both the sampler and ``Sequence`` (which keeps the
noise a seeded request drew ahead), so neither imports the other."""

from __future__ import annotations

import torch


def exponential(shape: torch.Size | tuple[int, ...], generator: torch.Generator | None) -> torch.Tensor:
    """Exponential(1) noise, ``-log U`` for ``U`` uniform in [0, 1): never 0 (a token
    of probability 0 never wins the race), ``inf`` where ``U`` is 0."""
    return torch.empty(shape).uniform_(generator=generator).log_().neg_()
