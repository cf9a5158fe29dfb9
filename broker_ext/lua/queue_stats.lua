#!lua flags=no-writes,allow-oom
--[[
queue_stats: one consistent snapshot of a queue, read-only.

KEYS[1] ready  KEYS[2] delayed  KEYS[3] leases  KEYS[4] dead  KEYS[5] state
KEYS[6] stats

Reply: {ready, delayed, leased, dead, expired_leases, oldest_ready_ms,
        server_now_ms, {counter name, value, ...}}
oldest_ready_ms is the publish time of the oldest ready message (0 if none).
--]]

local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local oldest = 0
for priority = 0, 9 do
  local first = redis.call('ZRANGE', KEYS[1], priority * 1e14 - 5e13, priority * 1e14 + 5e13,
    'BYSCORE', 'LIMIT', 0, 1)
  if first[1] then
    local st = redis.call('HGET', KEYS[5], first[1])
    local queued = st and tonumber(string.match(st, '|(%d+)$'))
    if queued and (oldest == 0 or queued < oldest) then oldest = queued end
  end
end
return {
  redis.call('ZCARD', KEYS[1]),
  redis.call('ZCARD', KEYS[2]),
  redis.call('ZCARD', KEYS[3]),
  redis.call('ZCARD', KEYS[4]),
  redis.call('ZCOUNT', KEYS[3], '-inf', now_ms),
  oldest,
  now_ms,
  redis.call('HGETALL', KEYS[6]),
}
