"""Which rank of a worker group holds each routed expert of a mixture-of-experts model.

One object answers it for every MoE layer (``ExpertMap``), so that a later load
balancer can move experts by building another map. Each rank runs its experts on the
tokens routed to them and the ranks' partial sums are all-reduced: in a group whose
ranks all hold every token (tensor parallel attention), that all-reduce is the
combine step, and the dispatch needs no all-to-all because every token is already on
every rank. Shared experts run on every rank, sharded like any MLP."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertMap:
    ranks: tuple[int, ...]  # expert id -> the rank that holds it
    world: int

    @classmethod
    def contiguous(cls, num_experts: int, world: int) -> ExpertMap:
        """Equal contiguous runs: rank r holds experts [r * E / N, (r + 1) * E / N)."""
        if num_experts % world:
            raise ValueError(f"num_experts ({num_experts}) is not divisible by the group's {world} ranks")
        return cls(tuple(e * world // num_experts for e in range(num_experts)), world)

    def local(self, rank: int) -> list[int]:
        """The experts ``rank`` holds, in id order (its local slots)."""
        return [e for e, r in enumerate(self.ranks) if r == rank]

    def tokens_per_rank(self, tokens_per_expert: list[int]) -> list[int]:
        """Routed (token, expert) pairs each rank computed, from the count per expert."""
        out = [0] * self.world
        for expert, count in enumerate(tokens_per_expert):
            out[self.ranks[expert]] += count
        return out
