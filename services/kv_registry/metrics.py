"""The kv-registry's Prometheus metrics: its Redis round trips (a command, or a pipeline
of them, sent and answered)."""

from __future__ import annotations

import redis.asyncio as redis
from prometheus_client import Counter

REDIS_ROUND_TRIPS = Counter("kervan_redis_round_trips", "Commands or pipelines the kv-registry sent to Redis")


class CountingConnection(redis.Connection):
    """A Redis connection that counts what it sends: one packed send is one round trip."""

    async def send_packed_command(self, command, check_health: bool = True) -> None:
        REDIS_ROUND_TRIPS.inc()
        await super().send_packed_command(command, check_health)
