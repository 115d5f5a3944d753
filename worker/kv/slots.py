"""What the tiers behind the pool share: an index of block hash -> slot, least recently
used first (``HostTier`` and ``DiskTier`` keep their blocks in numbered slots)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kervan.block_hash import BlockHash


class HashSlots:
    def __init__(self) -> None:
        self.slots: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first

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
