#!lua flags=allow-oom
--[[
reclaim: return deliveries whose lease has expired (by server time) to ready.

A reclaimed message goes to the front of its priority; its token is kept, so
the next claim fences the old holder off, while a holder that was only slow can
still ack (or extend) until then. A message that has used max_deliveries goes
to the dead-letter set with its reason instead of looping forever.

KEYS[1] leases  KEYS[2] state  KEYS[3] ready  KEYS[4] seq  KEYS[5] signal
KEYS[6] stats   KEYS[7] dead   KEYS[8] reasons

ARGV[1] max deliveries   ARGV[2] limit (messages per call)   ARGV[3] signal cap

Reply: {reclaimed, dead_lettered}
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]

local function check_type(key, want)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= want then
    error({err = 'FENCED WRONGTYPE ' .. key .. ' is a ' .. t .. ', expected ' .. want})
  end
end

local max_deliveries, limit, signal_cap = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if #KEYS ~= 8 or not max_deliveries or not limit or limit < 1 or not signal_cap then
  error({err = 'FENCED BADARG reclaim needs 8 keys, max deliveries, limit >= 1, signal cap'})
end
local types = {'zset', 'hash', 'zset', 'string', 'list', 'hash', 'zset', 'hash'}
for i = 1, 8 do check_type(KEYS[i], types[i]) end

local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local expired = redis.call('ZRANGE', KEYS[1], '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, limit)
local reclaimed, dead = 0, 0
for _, id in ipairs(expired) do
  redis.call('ZREM', KEYS[1], id)
  local st = redis.call('HGET', KEYS[2], id)
  if st then
    local token, deliveries, priority, queued = string.match(st, '^(%d+)|(%d+)|(%d+)|(%d+)$')
    if tonumber(deliveries) >= max_deliveries then
      redis.call('HSET', KEYS[2], id, string.format('%.0f', tonumber(token) + 1)
        .. '|' .. deliveries .. '|' .. priority .. '|' .. queued)
      redis.call('ZADD', KEYS[7], now_ms, id)
      redis.call('HSET', KEYS[8], id, cjson.encode({
        reason = 'lease expired on delivery ' .. deliveries .. ' (max_deliveries ' .. max_deliveries .. ')',
        at_ms = now_ms, deliveries = tonumber(deliveries)}))
      dead = dead + 1
    else
      local seq = redis.call('INCR', KEYS[4])
      redis.call('ZADD', KEYS[3], tonumber(priority) * 1e12 - seq, id)
      redis.call('LPUSH', KEYS[5], '1')
      reclaimed = reclaimed + 1
    end
  end
end
if reclaimed > 0 then
  redis.call('LTRIM', KEYS[5], 0, signal_cap - 1)
  redis.call('HINCRBY', KEYS[6], 'reclaimed', reclaimed)
end
if dead > 0 then redis.call('HINCRBY', KEYS[6], 'dead_lettered', dead) end
return {reclaimed, dead}
