"""What this scheduler placed that the workers' reports may not show yet.

Two lags hide recent placements. Load reports come when load changes, at most
every ~0.1 s, so a burst placed between two reports would all see the same idle
worker: each placement's prefill tokens and blocks count against its worker for
``load_window_s``. KV events come only after a prompt's blocks are computed (a
long prefill takes a second or more), so requests sharing a new prefix would all
miss it and scatter over the workers: the placed prompt's block hashes count as
the worker's (predicted) for ``prefix_window_s`` — the way SGLang's cache-aware
router and Dynamo's approximate indexer remember what they routed."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence


class RecentPlacements:
    def __init__(self, load_window_s: float = 0.1, prefix_window_s: float = 3.0,
                 clock: Callable[[], float] = time.monotonic):
        self.load_window_s = load_window_s
        self.prefix_window_s = prefix_window_s
        self.clock = clock
        self._placed: dict[str, deque[tuple[float, int, int]]] = {}  # worker -> (when, prefill tokens, blocks)
        self._prefixes: dict[str, dict[bytes, float]] = {}  # worker -> block hash -> when placed
        self._holders: dict[bytes, set[str]] = {}  # block hash -> the workers it was placed on (not yet expired)
        self._swept = clock()  # when every worker's prefixes were last expired

    def add(self, worker_id: str, prefill_tokens: int = 0, blocks: int = 0, block_hashes: Sequence[bytes] = ()) -> None:
        now = self.clock()
        self._placed.setdefault(worker_id, deque()).append((now, prefill_tokens, blocks))
        if block_hashes:
            predicted = self._prefixes.setdefault(worker_id, {})
            for h in block_hashes:
                predicted.pop(h, None)  # re-insert: the dict stays in placement order
                predicted[h] = now
                self._holders.setdefault(h, set()).add(worker_id)
        if now - self._swept > self.prefix_window_s:  # a worker no placement asks about still forgets
            self._swept = now
            for worker in list(self._prefixes):
                self._predicted(worker)

    def loaded_workers(self) -> list[str]:
        """The workers with placements within the load window."""
        return [w for w in list(self._placed) if self.pending(w) != (0, 0)]

    def holders(self, block_hash: bytes) -> list[str]:
        """The workers a prompt starting with ``block_hash`` was placed on within the prefix window."""
        return [w for w in list(self._holders.get(block_hash, ())) if self._predicted(w).get(block_hash) is not None]

    def pending(self, worker_id: str) -> tuple[int, int]:
        """(prefill tokens, KV blocks) placed on the worker within the load window."""
        placed = self._placed.get(worker_id)
        if not placed:
            return 0, 0
        horizon = self.clock() - self.load_window_s
        while placed and placed[0][0] < horizon:
            placed.popleft()
        if not placed:
            del self._placed[worker_id]
            return 0, 0
        return sum(p[1] for p in placed), sum(p[2] for p in placed)

    def sent_blocks(self, worker_id: str) -> int:
        """Distinct prompt blocks placed on the worker within the prefix window: content
        it holds or queues that its reports may not show yet."""
        return len(self._predicted(worker_id))

    def predicted_blocks(self, worker_id: str, block_hashes: list[bytes]) -> int:
        """Leading blocks of the prompt placed on the worker within the prefix window."""
        predicted = self._predicted(worker_id)
        n = 0
        while n < len(block_hashes) and block_hashes[n] in predicted:
            n += 1
        return n

    def _predicted(self, worker_id: str) -> dict[bytes, float]:
        predicted = self._prefixes.get(worker_id, {})
        horizon = self.clock() - self.prefix_window_s
        while predicted:  # oldest first: drop what the KV events have had time to confirm
            oldest = next(iter(predicted))
            if predicted[oldest] >= horizon:
                break
            del predicted[oldest]
            holders = self._holders.get(oldest)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._holders[oldest]
        if not predicted:
            self._prefixes.pop(worker_id, None)
        return predicted
