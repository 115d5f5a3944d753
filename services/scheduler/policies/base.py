"""The seam every placement policy implements, and the registry of them by name.

A policy picks one worker from a pool that placement's filters already cut to the
workers that may take the request (role, model, the request's size, admission, and,
unless the policy opts out, room for the prompt). A new policy is one new file in this
package: a ``PlacementPolicy`` subclass decorated with ``@register``; ``--policy`` then
offers its name (SGLang's router keeps one file per policy behind one trait the same way)."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import ClassVar

from services.scheduler.placement import Ask, Candidate, Choice, PlacementConfig, cost


class PlacementPolicy(ABC):
    """Chooses a worker from a non-empty, filtered pool. ``needs_room``: the pool is first cut
    to the workers with room for the prompt's blocks (when any has it); a policy that knows
    nothing of memory (as a hash ring) opts out."""

    name: ClassVar[str]
    needs_room: ClassVar[bool] = True

    def __init__(self, config: PlacementConfig, rng: random.Random | None = None):
        self.config = config
        self.rng = rng or random.Random()

    @abstractmethod
    def choose(self, pool: list[Candidate], ask: Ask) -> Choice: ...

    @property
    def remembers(self) -> bool:
        """Whether it keeps its own memory of what workers hold (``remembered_blocks``)."""
        return type(self).remembered_blocks is not PlacementPolicy.remembered_blocks

    @property
    def prunable(self) -> bool:
        """Whether it chooses the lowest ``placement.cost`` (ties by active blocks, then id), so
        that placement may price only the workers the shortlist leaves (``shortlist.py``)."""
        return False

    def remembered_blocks(self, worker_id: str, block_hashes: Sequence[bytes]) -> int | None:
        """Leading prompt blocks this policy itself remembers sending to the worker, or None:
        the registry's match (the workers' KV events) says what it holds."""
        return None

    def placed(self, worker_id: str, block_hashes: Sequence[bytes], live: Iterable[str]) -> None:  # noqa: B027
        """A request went to ``worker_id`` (not a dry run); ``live``: every worker now listed.
        Most policies remember nothing."""

    def costs(self, pool: list[Candidate], ask: Ask) -> dict[str, float]:
        return {c.worker_id: cost(c, ask.num_prompt_blocks, self.config) for c in pool}


POLICIES: dict[str, type[PlacementPolicy]] = {}


def register(cls: type[PlacementPolicy]) -> type[PlacementPolicy]:
    if cls.name in POLICIES:
        raise ValueError(f"two placement policies are named {cls.name!r}")
    POLICIES[cls.name] = cls
    return cls
