"""Work this scheduler placed that workers' load reports may not show yet.

Workers report their load when it changes, at most every ~0.1 s, so a burst of
requests placed between two reports would all see the same idle worker and pile
onto it. Like Dynamo's router, which tracks the sequences it routed, the
scheduler counts what it placed on each worker for ``window_s`` after placing it
— long enough for a report to include it, short enough not to double count
much."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable


class RecentPlacements:
    def __init__(self, window_s: float = 0.1, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._placed: dict[str, deque[tuple[float, int, int]]] = {}  # worker -> (when, prefill tokens, blocks)

    def add(self, worker_id: str, prefill_tokens: int = 0, blocks: int = 0) -> None:
        self._placed.setdefault(worker_id, deque()).append((self.clock(), prefill_tokens, blocks))

    def pending(self, worker_id: str) -> tuple[int, int]:
        """(prefill tokens, KV blocks) placed on the worker within the window."""
        placed = self._placed.get(worker_id)
        if not placed:
            return 0, 0
        horizon = self.clock() - self.window_s
        while placed and placed[0][0] < horizon:
            placed.popleft()
        if not placed:
            del self._placed[worker_id]
            return 0, 0
        return sum(p[1] for p in placed), sum(p[2] for p in placed)
