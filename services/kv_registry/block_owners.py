"""Which workers hold which KV block, as one small bitmap per block in Redis.

Every registered worker gets a slot (the lowest free one); ``blk:{hash}`` is a
bitmap with the owners' slot bits set, deleted when its last bit clears (KV events
write them in ``scripts.APPLY``, registration and purges in ``scripts.REGISTER``
and ``scripts.PURGE``). A longest-prefix match is then one round trip of one MGET
(plus the slot table's version and the unknown set, pipelined; the table itself only
when its version moved) and a walk of AND-ed integers on the client: a 128-block prompt
moves ~128 short strings, where a set per block (SMEMBERS of each) moved every owner's
id for every block and cost several times more (the registry benchmark measures both)."""

from __future__ import annotations

import redis.asyncio as redis


class BlockOwners:
    def __init__(self, client: redis.Redis, prefix: str):
        self.r = client
        self.slots_key = f"{prefix}slots"
        # bumped by every script that changes the slot table: a match reads it, not the table
        self.version_key = f"{prefix}slotsv"
        self.generation_key = f"{prefix}generation"  # a random id per Redis life (``generation.py``)
        self.block_prefix = f"{prefix}blk:"  # + a block hash in hex: its owners' bitmap
        self._slots: tuple[list, dict[int, str]] = ([None, None], {})  # (generation, version), slot -> id

    def key(self, block_hex: str) -> str:
        return self.block_prefix + block_hex

    async def match(self, block_hashes: list[bytes], unknown_key: str, tiered_key: str
                    ) -> tuple[dict[str, int], list[str], set[str]]:
        """Worker id -> how many leading blocks of the prompt it holds; the unknown workers;
        the workers that keep blocks in more than one tier."""
        async with self.r.pipeline(transaction=False) as pipe:
            if block_hashes:
                pipe.mget([self.key(h.hex()) for h in block_hashes])
            pipe.mget([self.generation_key, self.version_key])
            pipe.smembers(unknown_key)
            pipe.smembers(tiered_key)
            *bitmaps, version, unknown, tiered = await pipe.execute()
        unknown_ids = sorted(w.decode() for w in unknown)
        tiered_ids = {w.decode() for w in tiered}
        if not block_hashes:
            return {}, unknown_ids, tiered_ids
        return leading_owners(bitmaps[0], await self.slots(version)), unknown_ids, tiered_ids

    async def slots(self, version: list) -> dict[int, str]:
        """Slot -> worker id, read again only when the slot table's version moved: at a
        thousand workers the table is a millisecond of every match. A version is only
        trusted under a generation (a Redis that restarted empty counts versions again)."""
        cached, table = self._slots
        if version[0] is not None and version == cached:
            return table
        async with self.r.pipeline(transaction=True) as pipe:  # the table and its version together
            pipe.mget([self.generation_key, self.version_key])
            pipe.hgetall(self.slots_key)
            version, slots = await pipe.execute()
        table = {int(s): w.decode() for w, s in slots.items()}
        self._slots = (version, table)
        return table


def leading_owners(bitmaps: list[bytes | None], workers: dict[int, str]) -> dict[str, int]:
    """Slot bitmaps of consecutive blocks -> worker id -> leading blocks it holds.

    Redis numbers bitmap bits from the most significant bit of the first byte, so
    with every bitmap padded to one width, slot ``s`` is integer bit ``8 * width - 1 - s``."""
    width = max((len(b) for b in bitmaps if b), default=0)
    if not width:
        return {}
    top = 8 * width - 1
    counts: dict[str, int] = {}
    alive = -1  # all ones
    for i, raw in enumerate(bitmaps):
        now = alive & int.from_bytes((raw or b"").ljust(width, b"\0"), "big")
        dropped = alive & ~now if i else 0
        while dropped:
            bit = dropped.bit_length() - 1
            dropped &= ~(1 << bit)
            if top - bit in workers:
                counts[workers[top - bit]] = i
        alive = now
        if not alive:
            return counts
    while alive:
        bit = alive.bit_length() - 1
        alive &= ~(1 << bit)
        if top - bit in workers:
            counts[workers[top - bit]] = len(bitmaps)
    return counts
