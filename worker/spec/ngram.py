"""Prompt lookup (n-gram) proposals: the tokens that followed the latest earlier occurrence
of the context's last n tokens, longest n first (vLLM's ``ngram`` speculative method,
``prompt_lookup_min``/``prompt_lookup_max``). No weights, no state: a proposal is a pure
function of the tokens so far, so a migrated or preempted request proposes the same.

    context:  ... a b c [x y z] ... a b c | ?        (n = 3: "a b c" matched)
                      ^^^^^^^^^ proposed: x y z

The latest occurrence wins over earlier ones (recent text predicts the next tokens best:
the code being edited, the paragraph being summarized). A search compares every earlier
window of each n against the suffix: O(len(context) * n) numpy work per sequence and step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class NgramProposer:
    num_speculative_tokens: int
    min_n: int = 1
    max_n: int = 4

    def __post_init__(self):
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, not {self.num_speculative_tokens}")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, not {self.min_n}..{self.max_n}")

    def propose(self, tokens: Sequence[int]) -> list[int]:
        """Up to ``num_speculative_tokens`` guesses of the tokens after ``tokens``; [] when
        no n-gram of the suffix occurred earlier."""
        context = np.asarray(tokens, dtype=np.int64)
        length = len(context)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows starting at 0 .. length - n - 1: every earlier occurrence, not the suffix itself
            windows = sliding_window_view(context[:length - 1], n)
            hits = np.flatnonzero((windows == context[length - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return context[start:start + self.num_speculative_tokens].tolist()
        return []
