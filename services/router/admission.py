"""The router's slots for requests in flight, shared by its gRPC and HTTP fronts.

``max_in_flight`` requests in all, and at most ``max_per_key`` for the holders of one API key
(every caller is one holder without keys), so one tenant cannot take every slot. A gRPC
``Generate`` takes one slot for as long as it runs; the HTTP front asks for room for all of a
body's prompts before it starts any of them, and answers 429 without starting one when there
is none. A request past either limit is ``RESOURCE_EXHAUSTED``: retry later."""

from __future__ import annotations

from collections import Counter

from services.common.errors import Overloaded

RETRY_AFTER_S = 0.5


class Admission:
    def __init__(self, max_in_flight: int, max_per_key: int | None = None):
        if max_in_flight < 1 or (max_per_key is not None and max_per_key < 1):
            raise ValueError("max_in_flight and max_per_key must be at least 1")
        self.max_in_flight = max_in_flight
        self.max_per_key = min(max_per_key or max_in_flight, max_in_flight)
        self.num_in_flight = 0
        self.per_key: Counter[str] = Counter()

    def refusal(self, key: str, count: int = 1) -> str | None:
        """Why ``count`` more requests of ``key`` would be refused now (None: they fit)."""
        if self.num_in_flight + count > self.max_in_flight:
            return (f"the router has {self.num_in_flight} requests in flight and a limit of {self.max_in_flight}; "
                    f"retry later")
        if self.per_key[key] + count > self.max_per_key:
            return (f"this API key has {self.per_key[key]} requests in flight and a share of {self.max_per_key}; "
                    f"retry later")
        return None

    def take(self, key: str) -> None:
        """One slot for ``key``, or ``Overloaded``."""
        if (why := self.refusal(key)) is not None:
            raise Overloaded(why, RETRY_AFTER_S)
        self.num_in_flight += 1
        self.per_key[key] += 1

    def give_back(self, key: str) -> None:
        self.num_in_flight -= 1
        self.per_key[key] -= 1
        if not self.per_key[key]:
            del self.per_key[key]
