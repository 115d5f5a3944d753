"""What the tiers behind the pool share: an index of block hash -> slot, least recently
used first, and the free slots (``HostTier`` and ``DiskTier`` keep their blocks in
numbered slots)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kervan.block_hash import BlockHash


class HashSlots:
    # the free slots are handed out from slot 0 up, or (True) from the last slot down
    highest_first = False

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slots: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self.free = self._all_free()  # popped from the end
        self.num_dropped = 0  # blocks pushed out (least recently used)

    def claim(self, block_hash: BlockHash) -> tuple[int, BlockHash | None]:
        """A slot for a block not held: a free one, else the least recently used block's
        (pushed out, and returned with it)."""
        pushed = None
        if self.free:
            slot = self.free.pop()
        else:
            pushed, slot = self.slots.popitem(last=False)
            self.num_dropped += 1
        self.slots[block_hash] = slot
        return slot, pushed

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.slots

    def leading(self, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes``, from the first, the tier holds."""
        n = 0
        for h in hashes:
            if h not in self.slots:
                break
            n += 1
        return n

    def clear(self) -> None:
        """Forget every block: all slots free."""
        self.slots.clear()
        self.free = self._all_free()

    def _all_free(self) -> list[int]:
        return list(range(self.num_slots)) if self.highest_first else list(range(self.num_slots - 1, -1, -1))


def consecutive_runs(values: Sequence[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive ascending values, in order:
    ``[4, 5, 6, 2, 3]`` -> ``[(0, 3), (3, 2)]``."""
    runs: list[tuple[int, int]] = []
    for k, value in enumerate(values):
        if runs and value == values[k - 1] + 1:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((k, 1))
    return runs
