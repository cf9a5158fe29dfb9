#!lua
--[[
publish: store one or more messages and make each ready (or delayed), atomically.

Idempotent on the message id: an id that is stored, or was acked within the
done window, is not stored again and is reported DUPLICATE. A message with a
dedup key whose window is still open is reported DEDUPLICATED (the first
message keeps the key). Validates every argument and key type before the
first write. No flags: at maxmemory Redis refuses it before it starts.

KEYS[1]  bodies   hash   id -> payload
KEYS[2]  state    hash   id -> state record (see lua/include/state.lua)
KEYS[3]  ready    zset   id -> priority * 1e14 + seq
KEYS[4]  delayed  zset   id -> due ms (server time)
KEYS[5]  seq      string per-queue sequence
KEYS[6]  done     zset   recently acked ids
KEYS[7]  signal   list   consumer wake-up tokens
KEYS[8]  stats    hash   counters
KEYS[9]  dedups   list   recent deduplicated publishes (capped)
KEYS[9+i] dedup   string dedup key of message i (a placeholder key when it has none)

ARGV[1]  signal cap (max length of the signal list)
ARGV[2]  queue ttl ms (0: the queue does not expire): every key of the queue expires then,
         unless a consumer keeps it alive
ARGV[3+5*(i-1) ...] per message i: id, payload, priority 0-9, delay ms,
         dedup window ms (0: no dedup key)

Reply: one integer per message:
   1 STORED        stored and ready (or delayed)
   3 DUPLICATE     this id is already known: nothing written
   4 DEDUPLICATED  dedup key still held by another message: nothing written
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]
--- @include "check_types"
--- @include "arg_int"
--- @include "server_time"
--- @include "ready"
--- @include "keep_expiry"
local bodies, state, ready, delayed, seq, done, signal, stats, dedups =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local count = (#ARGV - 2) / 5
if count < 1 or count ~= math.floor(count) or #KEYS ~= 9 + count then
  error({err = 'FENCED BADARG publish needs 9 + n keys and 2 + 5n arguments'})
end
local signal_cap = arg_int(ARGV[1], 'signal cap', 1, 1e6)
local ttl = arg_int(ARGV[2], 'queue ttl', 0, 1e12)
local types = {{bodies, 'hash'}, {state, 'hash'}, {ready, 'zset'}, {delayed, 'zset'}, {seq, 'string'},
               {done, 'zset'}, {signal, 'list'}, {stats, 'hash'}, {dedups, 'list'}}
local messages = {}
for i = 1, count do
  local base = 3 + 5 * (i - 1)
  local id = ARGV[base]
  if id == '' or string.find(id, '\n', 1, true) then
    error({err = 'FENCED BADARG message ' .. i .. ': the id must be non-empty and hold no newline'})
  end
  messages[i] = {
    id = id, payload = ARGV[base + 1],
    priority = arg_int(ARGV[base + 2], 'priority of message ' .. i, 0, 9),
    delay = arg_int(ARGV[base + 3], 'delay ms of message ' .. i, 0, 1e12),
    window = arg_int(ARGV[base + 4], 'dedup window ms of message ' .. i, 0, 1e12),
    dedup = KEYS[9 + i],
  }
  if messages[i].window > 0 then types[#types + 1] = {messages[i].dedup, 'string'} end
end
check_types(types)

local now_ms = server_time()
local replies = {}
local stored, duplicates, deduplicated = 0, 0, 0
for i, m in ipairs(messages) do
  if redis.call('HEXISTS', state, m.id) == 1 or redis.call('ZSCORE', done, m.id) then
    replies[i] = 3
    duplicates = duplicates + 1
  elseif m.window > 0 and redis.call('EXISTS', m.dedup) == 1 then
    replies[i] = 4
    deduplicated = deduplicated + 1
    redis.call('LPUSH', dedups, cjson.encode({
      key = m.dedup, id = m.id, kept = redis.call('GET', m.dedup), at_ms = now_ms}))
    redis.call('LTRIM', dedups, 0, 999)
  else
    redis.call('HSET', bodies, m.id, m.payload)
    redis.call('HSET', state, m.id, '0|0|0|0|' .. m.priority .. '|' .. now_ms .. '|0|')
    if m.delay > 0 then
      redis.call('ZADD', delayed, now_ms + m.delay, m.id)
    else
      make_ready(ready, seq, m.id, m.priority, false)
      redis.call('LPUSH', signal, '1')
    end
    if m.window > 0 then
      redis.call('SET', m.dedup, m.id, 'PX', ttl > 0 and math.min(m.window, ttl) or m.window)
    end
    replies[i] = 1
    stored = stored + 1
  end
end
if stored > 0 then
  redis.call('LTRIM', signal, 0, signal_cap - 1)
  redis.call('HINCRBY', stats, 'published', stored)
end
if duplicates > 0 then redis.call('HINCRBY', stats, 'duplicate_publishes', duplicates) end
if deduplicated > 0 then redis.call('HINCRBY', stats, 'deduplicated_publishes', deduplicated) end
keep_expiry(ttl, {bodies, state, ready, delayed, seq, done, signal, stats, dedups})
return replies
