"""Redis restarting empty is a new generation of the registry's state.

The generation is a random id under ``kervan:generation``; a missing key (Redis
came back empty) or a different id (another Redis) starts a new one. Workers
notice by themselves — their next heartbeat names an incarnation Redis no longer
holds, so they register again and send full dumps — but for up to a lease the
live set would look empty. Meanwhile the registry keeps answering ``ListWorkers``
with the workers it last saw that have not re-registered yet (their KV overlap is
unknown, so placement runs on load alone) until ``grace_s`` has passed."""

from __future__ import annotations

import logging
import time
import uuid

import redis.asyncio as redis

log = logging.getLogger(__name__)


class Generations:
    def __init__(self, client: redis.Redis, key: str, grace_s: float, check_interval_s: float = 0.25):
        self.r = client
        self.key = key
        self.grace_s = grace_s
        self.check_interval_s = check_interval_s  # ListWorkers runs for every placement: not a GET each time
        self.current: str | None = None
        self.rebuilding_until = 0.0
        self.started = 0  # generations seen after the first
        self._checked_at = float("-inf")

    async def check(self, force: bool = False) -> None:
        """Reads the generation, at most every ``check_interval_s`` unless ``force``."""
        now = time.monotonic()
        if not force and now - self._checked_at < self.check_interval_s:
            return
        self._checked_at = now
        gen = await self.r.get(self.key)
        if gen is None:
            await self.r.set(self.key, uuid.uuid4().hex, nx=True)
            gen = await self.r.get(self.key)
        gen = gen.decode() if isinstance(gen, bytes) else str(gen)
        if self.current is not None and gen != self.current:
            self.started += 1
            self.rebuilding_until = time.monotonic() + self.grace_s
            log.warning("Redis holds a new generation (%s, was %s): workers re-register and re-send their blocks",
                        gen, self.current)
        self.current = gen

    @property
    def rebuilding(self) -> bool:
        return time.monotonic() < self.rebuilding_until
