#!lua flags=no-writes,allow-oom
--[[
queue_stats: one consistent snapshot of a queue, read-only.

KEYS[1] ready    zset
KEYS[2] delayed  zset
KEYS[3] leases   zset
KEYS[4] dead     zset
KEYS[5] state    hash
KEYS[6] stats    hash

Reply: {ready, delayed, leased, dead, expired_leases, oldest_ready_ms,
        server_now_ms, {counter name, value, ...}}
oldest_ready_ms is the publish time of the oldest ready message (0 if none).
--]]
--- @include "server_time"
--- @include "state"
local ready, delayed, leases, dead, state, stats = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
if #KEYS ~= 6 then error({err = 'FENCED BADARG queue_stats needs 6 keys'}) end
local now_ms = server_time()
local oldest = 0
for priority = 0, 9 do
  local first = redis.call('ZRANGE', ready, priority * 1e14 - 5e13, priority * 1e14 + 5e13,
    'BYSCORE', 'LIMIT', 0, 1)
  if first[1] then
    local s = parse_state(redis.call('HGET', state, first[1]))
    local queued = s and tonumber(s.queued)
    if queued and (oldest == 0 or queued < oldest) then oldest = queued end
  end
end
return {
  redis.call('ZCARD', ready),
  redis.call('ZCARD', delayed),
  redis.call('ZCARD', leases),
  redis.call('ZCARD', dead),
  redis.call('ZCOUNT', leases, '-inf', now_ms),
  oldest,
  now_ms,
  redis.call('HGETALL', stats),
}
