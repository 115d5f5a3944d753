"""The registry's Redis scripts: each checks the caller's incarnation and makes its
change in the same atomic step, so a worker whose lease was lost (a zombie woken
up) can neither renew it nor write KV ownership — there is no moment between the
check and the write for the registry to purge it."""

from __future__ import annotations

# KEYS: w:{id}, unknown; ARGV: incarnation, worker id, ttl, then load field/value pairs.
# Returns -1 (stale incarnation), else whether the registry wants the worker's full dump.
RENEW = """
if redis.call('HGET', KEYS[1], 'incarnation') ~= ARGV[1] then return -1 end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], ARGV[3])
return redis.call('SISMEMBER', KEYS[2], ARGV[2])
"""

# KEYS: w:{id}, own:{id}, seq:{id}, unknown; ARGV: incarnation, worker id, block key
# prefix, replace ("1": a full dump, whose seq is taken as is and which makes the
# worker known again), then per event: kind (S stored, R removed, C cleared), seq,
# tier, n, n block hashes (hex). Events at or below the last applied seq are skipped
# (retries are idempotent); a jump in seq marks the worker unknown. Returns -1 (stale
# incarnation), else {last seq, 1 if the registry wants a full dump, 1 if this call found a gap}.
APPLY = """
if redis.call('HGET', KEYS[1], 'incarnation') ~= ARGV[1] then return -1 end
local slot = tonumber(redis.call('HGET', KEYS[1], 'slot'))
local prefix = ARGV[3]
local replace = ARGV[4] == '1'
local last = tonumber(redis.call('GET', KEYS[3]) or '0')
local gap = false

local function clear(key)
  redis.call('SETBIT', key, slot, 0)
  if redis.call('BITCOUNT', key) == 0 then redis.call('DEL', key) end
end

local i = 5
while i <= #ARGV do
  local kind, seq, tier, n = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], tonumber(ARGV[i + 3])
  local first = i + 4
  i = first + n
  if replace or seq > last then
    if not replace and seq ~= last + 1 then gap = true end
    last = seq
    if kind == 'S' then
      for j = first, first + n - 1 do
        redis.call('SETBIT', prefix .. ARGV[j], slot, 1)
        redis.call('HSET', KEYS[2], ARGV[j], tier)
      end
    elseif kind == 'R' then
      for j = first, first + n - 1 do
        clear(prefix .. ARGV[j])
        redis.call('HDEL', KEYS[2], ARGV[j])
      end
    elseif kind == 'C' then
      for _, h in ipairs(redis.call('HKEYS', KEYS[2])) do clear(prefix .. h) end
      redis.call('DEL', KEYS[2])
    end
  end
end
redis.call('SET', KEYS[3], last)
if replace then redis.call('SREM', KEYS[4], ARGV[2]) elseif gap then redis.call('SADD', KEYS[4], ARGV[2]) end
return {last, redis.call('SISMEMBER', KEYS[4], ARGV[2]), gap and 1 or 0}
"""

# Lua shared by REGISTER and PURGE: drop everything the registry holds for a worker
# (its blocks' owner bits, its keys, its slot). Keys as in those two scripts.
_DROP = """
local function drop(worker_id, prefix)
  local slot = redis.call('HGET', KEYS[6], worker_id)
  if slot then
    for _, h in ipairs(redis.call('HKEYS', KEYS[5])) do
      local key = prefix .. h
      redis.call('SETBIT', key, slot, 0)
      if redis.call('BITCOUNT', key) == 0 then redis.call('DEL', key) end
    end
  end
  redis.call('DEL', KEYS[5], KEYS[1], KEYS[2])
  redis.call('SREM', KEYS[3], worker_id)
  redis.call('SREM', KEYS[4], worker_id)
  redis.call('HDEL', KEYS[6], worker_id)
end
"""

# KEYS: w:{id}, seq:{id}, workers, unknown, own:{id}, slots, fence; ARGV: worker id,
# block key prefix, ttl, a random nonce, then the record's field/value pairs. A live lease under the
# id refuses the call (-1): two processes must not share an id. Leftovers of an
# expired one are dropped; the worker gets the lowest free slot and a new fencing
# token: INCR (ordered), and the caller's nonce (a Redis that restarted empty counts
# from 1 again). Returns {token, slot}.
REGISTER = _DROP + """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
drop(ARGV[1], ARGV[2])
local used = {}
for _, s in ipairs(redis.call('HVALS', KEYS[6])) do used[tonumber(s)] = true end
local slot = 0
while used[slot] do slot = slot + 1 end
redis.call('HSET', KEYS[6], ARGV[1], slot)
local token = redis.call('INCR', KEYS[7]) .. '.' .. ARGV[4]
redis.call('HSET', KEYS[1], 'incarnation', token, 'slot', slot, unpack(ARGV, 5))
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[1])
return {token, slot}
"""

# KEYS as REGISTER's (without fence); ARGV: worker id, block key prefix, the
# incarnation the caller saw ('' : the lease had expired). Purges only if the worker
# is still in that state, so a worker that re-registered meanwhile keeps its slot
# and keys. Returns 1 if purged, else 0.
PURGE = _DROP + """
local current = redis.call('HGET', KEYS[1], 'incarnation')
if ARGV[3] == '' then
  if current then return 0 end
elseif current ~= ARGV[3] then
  return 0
end
drop(ARGV[1], ARGV[2])
return 1
"""

# KEYS: workers; ARGV: the lease key prefix (w:). Every registered worker's id and lease
# hash as one reply ({id, {field, value, ...}, ...}; an empty hash where the lease expired),
# where a pipeline of an HGETALL per worker paid redis-py's per-command cost 1,000 times
# (reading 1,000 workers: 104 ms pipelined, 41-68 ms this way, the rest decoding in Python).
# It reads keys it is not given (the leases): fine on one Redis or a Sentinel-managed one,
# not on Redis Cluster, which Kervan does not use.
LIVE = """
local ids = redis.call('SMEMBERS', KEYS[1])
local out = {}
for i, id in ipairs(ids) do
  out[2 * i - 1] = id
  out[2 * i] = redis.call('HGETALL', ARGV[1] .. id)
end
return out
"""
