#!lua
--[[
publish: store one or more messages and make each ready (or delayed), atomically.

Idempotent on the message id: an id that is stored, or was acked within the
done window, is not stored again and is reported DUPLICATE. A message with a
dedup key whose window is still open is reported DEDUPLICATED (the first
message keeps the key). Validates every key type before the first write.

KEYS[1]  bodies   hash   id -> payload
KEYS[2]  state    hash   id -> "token|deliveries|priority|queued_ms"
KEYS[3]  ready    zset   id -> priority * 1e14 + seq
KEYS[4]  delayed  zset   id -> due ms (server time)
KEYS[5]  seq      string per-queue sequence
KEYS[6]  done     zset   recently acked ids
KEYS[7]  signal   list   consumer wake-up tokens
KEYS[8]  stats    hash   counters
KEYS[9]  dedups   list   recent deduplicated publishes (capped)
KEYS[9+i] dedup key of message i (a placeholder key when it has none)

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

local count = (#ARGV - 2) / 5
if count < 1 or count ~= math.floor(count) or #KEYS ~= 9 + count then
  error({err = 'FENCED BADARG publish needs 9 + n keys and 2 + 5n arguments'})
end
local signal_cap = tonumber(ARGV[1])
local ttl = tonumber(ARGV[2])
if not signal_cap or not ttl then
  error({err = 'FENCED BADARG signal cap and ttl must be numbers'})
end
local types = {'hash', 'hash', 'zset', 'zset', 'string', 'zset', 'list', 'hash', 'list'}
for i = 1, 9 do check_type(KEYS[i], types[i]) end
for i = 1, count do
  local base = 3 + 5 * (i - 1)
  local priority = tonumber(ARGV[base + 2])
  if ARGV[base] == '' or string.find(ARGV[base], '\n', 1, true) or not priority or priority < 0 or priority > 9
      or priority ~= math.floor(priority) or not tonumber(ARGV[base + 3]) or not tonumber(ARGV[base + 4]) then
    error({err = 'FENCED BADARG message ' .. i .. ': id (no newline), integer priority 0-9, delay and window'})
  end
  if tonumber(ARGV[base + 4]) > 0 then check_type(KEYS[9 + i], 'string') end
end

local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local replies = {}
local stored, duplicates, deduplicated = 0, 0, 0
for i = 1, count do
  local base = 3 + 5 * (i - 1)
  local id, payload = ARGV[base], ARGV[base + 1]
  local priority = tonumber(ARGV[base + 2])
  local delay, window = tonumber(ARGV[base + 3]), tonumber(ARGV[base + 4])
  if redis.call('HEXISTS', KEYS[2], id) == 1 or redis.call('ZSCORE', KEYS[6], id) then
    replies[i] = 3
    duplicates = duplicates + 1
  elseif window > 0 and redis.call('EXISTS', KEYS[9 + i]) == 1 then
    replies[i] = 4
    deduplicated = deduplicated + 1
    redis.call('LPUSH', KEYS[9], cjson.encode({
      key = KEYS[9 + i], id = id, kept = redis.call('GET', KEYS[9 + i]), at_ms = now_ms}))
    redis.call('LTRIM', KEYS[9], 0, 999)
  else
    redis.call('HSET', KEYS[1], id, payload)
    redis.call('HSET', KEYS[2], id, '0|0|' .. priority .. '|' .. now_ms)
    if delay > 0 then
      redis.call('ZADD', KEYS[4], now_ms + delay, id)
    else
      local seq = redis.call('INCR', KEYS[5])
      redis.call('ZADD', KEYS[3], priority * 1e14 + seq, id)
      redis.call('LPUSH', KEYS[7], '1')
    end
    if window > 0 then
      redis.call('SET', KEYS[9 + i], id, 'PX', window)
    end
    replies[i] = 1
    stored = stored + 1
  end
end
if stored > 0 then
  redis.call('LTRIM', KEYS[7], 0, signal_cap - 1)
  redis.call('HINCRBY', KEYS[8], 'published', stored)
  if ttl > 0 then
    for k = 1, 9 do redis.call('PEXPIRE', KEYS[k], ttl) end
  end
end
if duplicates > 0 then redis.call('HINCRBY', KEYS[8], 'duplicate_publishes', duplicates) end
if deduplicated > 0 then redis.call('HINCRBY', KEYS[8], 'deduplicated_publishes', deduplicated) end
return replies
