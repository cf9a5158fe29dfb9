#!lua flags=allow-oom
--[[
reclaim: return deliveries whose lease has expired (by server time) to ready.

A reclaimed message goes to the front of its priority; its token is kept, so
the next claim fences the old holder off, while a holder that was only slow can
still ack (or extend) until then. A message that has used max_deliveries goes
to the dead-letter set with its reason instead of looping forever, and so does
one whose state is corrupt. A lease entry whose message is gone (no state) is
a stray and is removed.

Reads and checks every expired lease first; writes after.

KEYS[1] leases  KEYS[2] state  KEYS[3] ready  KEYS[4] seq  KEYS[5] signal
KEYS[6] stats   KEYS[7] dead   KEYS[8] reasons

ARGV[1] max deliveries   ARGV[2] limit (messages per call)   ARGV[3] signal cap

Reply: {reclaimed, dead_lettered}
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]

local max_deliveries, limit, signal_cap = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if #KEYS ~= 8 or not max_deliveries or not limit or limit < 1 or not signal_cap then
  error({err = 'FENCED BADARG reclaim needs 8 keys, max deliveries, limit >= 1, signal cap'})
end

local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local expired = redis.call('ZRANGE', KEYS[1], '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, limit)
if #expired == 0 then return {0, 0} end  -- the usual case: nothing written, nothing to check
local types = {'zset', 'hash', 'zset', 'string', 'list', 'hash', 'zset', 'hash'}
for i = 1, 8 do check_type(KEYS[i], types[i]) end
local raw_states = {}
for i, id in ipairs(expired) do raw_states[i] = redis.call('HGET', KEYS[2], id) end

local reclaimed, dead, strays = 0, 0, 0
local function dead_letter(id, deliveries, reason)
  redis.call('ZADD', KEYS[7], now_ms, id)
  redis.call('HSET', KEYS[8], id, cjson.encode({reason = reason, at_ms = now_ms, deliveries = deliveries}))
  dead = dead + 1
end

for i, id in ipairs(expired) do
  redis.call('ZREM', KEYS[1], id)
  local st = raw_states[i]
  local state = st and parse_state(st)
  if not st then
    strays = strays + 1
  elseif not state then
    redis.call('HSET', KEYS[2], id, string.format('%.0f', tonumber(now[1]) * 1000000 + tonumber(now[2]))
      .. '|0|0|' .. now_ms)
    dead_letter(id, 0, 'undeliverable: corrupt state')
  elseif state.deliveries >= max_deliveries then
    redis.call('HSET', KEYS[2], id, string.format('%.0f', state.token + 1)
      .. '|' .. state.deliveries .. '|' .. state.priority .. '|' .. state.queued)
    dead_letter(id, state.deliveries,
      'lease expired on delivery ' .. state.deliveries .. ' (max_deliveries ' .. max_deliveries .. ')')
  else
    local seq = redis.call('INCR', KEYS[4])
    redis.call('ZADD', KEYS[3], state.priority * 1e14 - seq, id)
    redis.call('LPUSH', KEYS[5], '1')
    reclaimed = reclaimed + 1
  end
end
if reclaimed > 0 then
  redis.call('LTRIM', KEYS[5], 0, signal_cap - 1)
  redis.call('HINCRBY', KEYS[6], 'reclaimed', reclaimed)
end
if dead > 0 then redis.call('HINCRBY', KEYS[6], 'dead_lettered', dead) end
if strays > 0 then redis.call('HINCRBY', KEYS[6], 'stray_leases_removed', strays) end
return {reclaimed, dead}
