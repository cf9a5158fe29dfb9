#!lua flags=allow-oom
--[[
reclaim: return deliveries whose lease has expired (by server time) to ready.

A reclaimed message goes to the front of its priority; its token is kept, so
the next claim fences the old holder off, while a holder that was only slow can
still ack (or extend) until then. A message that has used max_deliveries goes
to the dead-letter set with its reason instead of looping forever, and so does
one whose state is corrupt. A lease entry whose message is gone (no state) is
a stray and is removed. Every expiry is also written to the queue's reclaim
log (capped), so that ops can later tell why a message was delivered again:
whose lease expired, with which token, and when its holder last extended it.

Reads and checks every expired lease first; writes after.

KEYS[1] leases  KEYS[2] state  KEYS[3] ready  KEYS[4] seq  KEYS[5] signal
KEYS[6] stats   KEYS[7] dead   KEYS[8] reasons  KEYS[9] reclaims (list)

ARGV[1] max deliveries   ARGV[2] limit (messages per call)   ARGV[3] signal cap
ARGV[4] lease ms (to tell when the holder last extended: deadline - lease)

Reply: {reclaimed, dead_lettered, id, reason, id, reason, ...} (the ids dead-lettered now)
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]

local max_deliveries, limit, signal_cap = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local lease = tonumber(ARGV[4])
if #KEYS ~= 9 or not max_deliveries or not limit or limit < 1 or not signal_cap or not lease then
  error({err = 'FENCED BADARG reclaim needs 9 keys, max deliveries, limit >= 1, signal cap, lease'})
end

local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local expired = redis.call('ZRANGE', KEYS[1], '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, limit, 'WITHSCORES')
if #expired == 0 then return {0, 0} end  -- the usual case: nothing written, nothing to check
local types = {'zset', 'hash', 'zset', 'string', 'list', 'hash', 'zset', 'hash', 'list'}
for i = 1, 9 do check_type(KEYS[i], types[i]) end
local ids, deadlines, raw_states = {}, {}, {}
for i = 1, #expired, 2 do
  ids[#ids + 1] = expired[i]
  deadlines[#ids] = tonumber(expired[i + 1])
  raw_states[#ids] = redis.call('HGET', KEYS[2], expired[i])
end

local reclaimed, dead, strays = 0, 0, 0
local out = {0, 0}
local function dead_letter(id, deliveries, reason)
  redis.call('ZADD', KEYS[7], now_ms, id)
  redis.call('HSET', KEYS[8], id, cjson.encode({reason = reason, at_ms = now_ms, deliveries = deliveries}))
  dead = dead + 1
  out[#out + 1] = id
  out[#out + 1] = reason
end

for i, id in ipairs(ids) do
  redis.call('ZREM', KEYS[1], id)
  local st = raw_states[i]
  local state = st and parse_state(st)
  if state then
    redis.call('LPUSH', KEYS[9], cjson.encode({
      id = id, token = string.format('%.0f', state.token), deliveries = state.deliveries,
      deadline_ms = deadlines[i], last_extended_ms = deadlines[i] - lease, at_ms = now_ms}))
  end
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
if reclaimed + dead > 0 then redis.call('LTRIM', KEYS[9], 0, 999) end
if reclaimed > 0 then
  redis.call('LTRIM', KEYS[5], 0, signal_cap - 1)
  redis.call('HINCRBY', KEYS[6], 'reclaimed', reclaimed)
end
if dead > 0 then redis.call('HINCRBY', KEYS[6], 'dead_lettered', dead) end
if strays > 0 then redis.call('HINCRBY', KEYS[6], 'stray_leases_removed', strays) end
out[1], out[2] = reclaimed, dead
return out
