"""The registry's Redis scripts: each checks the caller's incarnation and makes its
change in the same atomic step, so a worker whose lease was lost (a zombie woken
up) can neither renew it nor write KV ownership — there is no moment between the
check and the write for the registry to purge it."""

from __future__ import annotations

# a worker's id is published here when it registers, renews or is dropped (``live_feed.py``)
LIVE_CHANNEL = "kervan:live"
# how far past the last applied seq an event may jump while the worker's registration lives (a
# live worker's gaps are the events of a few seconds): further is refused, so a forged seq of 10^9
# cannot make the registry skip the worker's own later events; after a re-registration (last = 0)
# any seq starts the count
MAX_SEQ_JUMP = 1 << 20

# KEYS: w:{id}, unknown; ARGV: incarnation, worker id, ttl, then load field/value pairs.
# Returns -1 (stale incarnation), else whether the registry wants the worker's full dump.
RENEW = """
if redis.call('HGET', KEYS[1], 'incarnation') ~= ARGV[1] then return -1 end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('PUBLISH', '""" + LIVE_CHANNEL + """', ARGV[2])
return redis.call('SISMEMBER', KEYS[2], ARGV[2])
"""

# Lua shared by the scripts that free a worker's blocks: its ownership hash is renamed
# to purging:{slot} and the slot parked in the retired hash, taken until ``SWEEP`` has
# cleared its bits in bounded batches (a worker holding a million blocks is not one
# script that holds Redis for seconds, as a walk of them all was). ``free_slot``: the
# lowest slot neither in use nor retired. KEYS here: slots (6), retired (7); ARGV[2]:
# the block key prefix, ARGV[3]: the purging key prefix (as every caller passes them).
_SLOTS = """
local function retire(slot, own_key, worker_id)
  if redis.call('EXISTS', own_key) == 1 then
    redis.call('RENAME', own_key, ARGV[3] .. slot)
    redis.call('HSET', KEYS[7], slot, worker_id)
  end
end

local function free_slot()
  local used = {}
  for _, s in ipairs(redis.call('HVALS', KEYS[6])) do used[tonumber(s)] = true end
  for _, s in ipairs(redis.call('HKEYS', KEYS[7])) do used[tonumber(s)] = true end
  local slot = 0
  while used[slot] do slot = slot + 1 end
  return slot
end
"""

# KEYS: w:{id}, own:{id}, seq:{id}, unknown, tiered, slots, retired, slots version; ARGV: incarnation,
# block key prefix, purging key prefix, mode ("0": events; "1": part of a full dump, whose
# seq is taken as is; "2": its last part, which makes the worker known again), worker id,
# the registry's bound on the blocks of a worker (one that registered its capacity is held
# to that, if lower), then per event: kind (S stored, R removed, C cleared; s and
# r: the rest of the event before, applied only right after it), seq, tier, n, n block
# hashes (hex). Events at or below the last applied seq are skipped (retries are
# idempotent); a jump in seq marks the worker unknown; a jump past MAX_SEQ_JUMP is refused
# (-3). A call that would leave the worker holding more blocks than it may is refused whole
# (-2). A clear moves the worker to a new slot and retires the old one (its bits are swept in
# batches). A worker that stores a block in a tier other than the device's joins the tiered
# set (matches then read its tiers). Returns -1 (stale incarnation), -2, -3, else {last seq,
# 1 if the registry wants a full dump, 1 if this call found a gap}.
APPLY = _SLOTS + f"local max_jump = {MAX_SEQ_JUMP}" + """
if redis.call('HGET', KEYS[1], 'incarnation') ~= ARGV[1] then return -1 end
local slot = tonumber(redis.call('HGET', KEYS[1], 'slot'))
local prefix = ARGV[2]
local mode = ARGV[4]
local replace = mode ~= '0'
local worker_id = ARGV[5]
local last = tonumber(redis.call('GET', KEYS[3]) or '0')
local gap = false

local held = redis.call('HLEN', KEYS[2])
local i = 7
while i <= #ARGV do
  local kind, n = ARGV[i], tonumber(ARGV[i + 3])
  if kind == 'C' then held = 0 elseif kind == 'S' or kind == 's' then held = held + n end
  if mode == '0' and last > 0 and tonumber(ARGV[i + 1]) > last + max_jump then return -3 end
  i = i + 4 + n
end
local cap = tonumber(redis.call('HGET', KEYS[1], 'kv_capacity_blocks') or '0')
if cap == 0 or cap > tonumber(ARGV[6]) then cap = tonumber(ARGV[6]) end
if held > cap + math.floor(cap / 10) + 64 then return -2 end  -- slack: events lag the cache a little

local function clear(key)
  redis.call('SETBIT', key, slot, 0)
  if redis.call('BITCOUNT', key) == 0 then redis.call('DEL', key) end
end

i = 7
while i <= #ARGV do
  local kind, seq, tier, n = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], tonumber(ARGV[i + 3])
  local first = i + 4
  i = first + n
  local rest = kind == 's' or kind == 'r'
  if replace or (rest and seq == last) or (not rest and seq > last) then
    if not replace and not rest and seq ~= last + 1 then gap = true end
    last = seq
    if kind == 'S' or kind == 's' then
      for j = first, first + n - 1 do
        redis.call('SETBIT', prefix .. ARGV[j], slot, 1)
        redis.call('HSET', KEYS[2], ARGV[j], tier)
      end
      if n > 0 and tier ~= 'device' and tier ~= '' then redis.call('SADD', KEYS[5], worker_id) end
    elseif kind == 'R' or kind == 'r' then
      for j = first, first + n - 1 do
        clear(prefix .. ARGV[j])
        redis.call('HDEL', KEYS[2], ARGV[j])
      end
    elseif kind == 'C' then
      retire(slot, KEYS[2], worker_id)
      slot = free_slot()
      redis.call('HSET', KEYS[6], worker_id, slot)
      redis.call('INCR', KEYS[8])
      redis.call('HSET', KEYS[1], 'slot', slot)
    end
  end
end
redis.call('SET', KEYS[3], last)
if mode == '2' then redis.call('SREM', KEYS[4], worker_id) elseif gap then redis.call('SADD', KEYS[4], worker_id) end
return {last, redis.call('SISMEMBER', KEYS[4], worker_id), gap and 1 or 0}
"""

# Lua shared by REGISTER and PURGE: drop what the registry holds for a worker (its keys;
# its blocks' owner bits by retiring its slot). Keys as in those two scripts.
_DROP = _SLOTS + """
local function drop(worker_id)
  local slot = redis.call('HGET', KEYS[6], worker_id)
  if slot then retire(slot, KEYS[5], worker_id) end
  redis.call('DEL', KEYS[5], KEYS[1], KEYS[2])
  redis.call('SREM', KEYS[3], worker_id)
  redis.call('SREM', KEYS[4], worker_id)
  redis.call('SREM', KEYS[8], worker_id)
  if redis.call('HDEL', KEYS[6], worker_id) == 1 then redis.call('INCR', KEYS[9]) end
  redis.call('PUBLISH', '""" + LIVE_CHANNEL + """', worker_id)
end
"""

# KEYS: w:{id}, seq:{id}, workers, unknown, own:{id}, slots, retired, tiered, slots version, fence;
# ARGV: worker id,
# block key prefix, purging key prefix, ttl, a random nonce, the caller's registration
# nonce, then the record's field/value pairs. A live lease under the id refuses the call
# (-1): two processes must not share an id, unless it is the same registration asked again
# (its nonce: a retry after a timeout gets it back). Leftovers of an expired one are
# dropped; the worker gets the lowest free slot and a new fencing token: INCR (ordered), and
# the random nonce (a Redis that restarted empty counts from 1 again). Returns {token, slot}.
REGISTER = _DROP + """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local same = redis.call('HMGET', KEYS[1], 'registration_nonce', 'incarnation', 'slot')
  if ARGV[6] ~= '' and same[1] == ARGV[6] then return {same[2], tonumber(same[3])} end
  return -1
end
drop(ARGV[1])
local slot = free_slot()
redis.call('HSET', KEYS[6], ARGV[1], slot)
redis.call('INCR', KEYS[9])
local token = redis.call('INCR', KEYS[10]) .. '.' .. ARGV[5]
redis.call('HSET', KEYS[1], 'incarnation', token, 'slot', slot, unpack(ARGV, 7))
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('PUBLISH', '""" + LIVE_CHANNEL + """', ARGV[1])
return {token, slot}
"""

# KEYS as REGISTER's (without fence); ARGV: worker id, block key prefix, purging key prefix,
# the incarnation the caller saw ('' : the lease had expired). Purges only if the worker is
# still in that state, so a worker that re-registered meanwhile keeps its slot and keys.
# Returns 1 if purged, else 0.
PURGE = _DROP + """
local current = redis.call('HGET', KEYS[1], 'incarnation')
if ARGV[4] == '' then
  if current then return 0 end
elseif current ~= ARGV[4] then
  return 0
end
drop(ARGV[1])
return 1
"""

# KEYS: retired; ARGV: block key prefix, purging key prefix, batch size. Clears the bits of
# at most a batch of one retired slot's blocks; a slot whose blocks are all cleared is free
# again. Returns how many retired slots there were (0: nothing left to sweep).
SWEEP = """
local slots = redis.call('HKEYS', KEYS[1])
if #slots == 0 then return 0 end
local slot = slots[1]
local key = ARGV[2] .. slot
local fields = redis.call('HRANDFIELD', key, ARGV[3])  -- up to a batch of distinct fields (Redis 6.2+)
for i = 1, #fields do
  local block = ARGV[1] .. fields[i]
  redis.call('SETBIT', block, tonumber(slot), 0)
  if redis.call('BITCOUNT', block) == 0 then redis.call('DEL', block) end
  redis.call('HDEL', key, fields[i])
end
if redis.call('EXISTS', key) == 0 then redis.call('HDEL', KEYS[1], slot) end
return #slots
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


# KEYS: cert:{identity}; ARGV: worker id, lease key prefix, ttl. "ok", or the live id the
# certificate already holds.
CLAIM_IDENTITY = """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] and redis.call('EXISTS', ARGV[2] .. held) == 1 then
  return held
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[3]))
return 'ok'
"""
