"""Longest-prefix match inside Redis: one command, a reply of a few bytes.

The script (KEYS: the set of unknown workers, then the prompt's block keys) walks the prompt's block keys in order, keeping the workers that held
every block so far, and stops at the first block none of them holds. Run in
Redis, a 128-block prompt costs one round trip and reads only as many sets as
the longest match needs; a client-side pipeline would ship every block's owner
set back to be intersected in Python (the registry benchmark compares the two).

All keys are passed as KEYS, so the script also runs on a Redis Cluster when the
block keys share a hash tag (they do not today: one Redis)."""

from __future__ import annotations

import redis.asyncio as redis

LUA = """
local alive = nil
local counts = {}
for i = 2, #KEYS do
  local members = redis.call('SMEMBERS', KEYS[i])
  local still = {}
  local any = false
  for _, w in ipairs(members) do
    if alive == nil or alive[w] then
      still[w] = true
      counts[w] = i - 1
      any = true
    end
  end
  if not any then break end
  alive = still
end
local out = {}
for w, n in pairs(counts) do
  out[#out + 1] = w
  out[#out + 1] = n
end
return {redis.call('SMEMBERS', KEYS[1]), out}
"""


class PrefixMatcher:
    def __init__(self, client: redis.Redis, block_key_prefix: str, unknown_key: str):
        self.script = client.register_script(LUA)
        self.block_key_prefix = block_key_prefix
        self.unknown_key = unknown_key

    async def __call__(self, block_hashes: list[bytes]) -> tuple[dict[str, int], list[str]]:
        """Worker id -> how many leading blocks of the prompt it holds; unknown workers."""
        unknown, flat = await self.script(
            keys=[self.unknown_key, *(f"{self.block_key_prefix}{h.hex()}" for h in block_hashes)])
        return ({flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)},
                sorted(w.decode() for w in unknown))
