#!lua flags=no-writes,allow-oom
--[[
queue_stats: one consistent snapshot of a queue, read-only.

KEYS[1] ready    zset
KEYS[2] delayed  zset
KEYS[3] leases   zset
KEYS[4] dead     zset
KEYS[5] state    hash
KEYS[6] stats    hash    the counters an earlier version kept (added in)
KEYS[7] counters string  (lua/include/counters.lua)

Reply: {ready, delayed, leased, dead, expired_leases, oldest_ready_ms,
        server_now_ms, {counter name, value, ...}}
oldest_ready_ms is the publish time of the oldest ready message (0 if none).
--]]
--- @include "server_time"
--- @include "state"
--- @include "counters"
local ready, delayed, leases, dead, state, stats, counters =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
if #KEYS ~= 7 then error({err = 'FENCED BADARG queue_stats needs 7 keys'}) end
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
-- Every counter but the sequence, the earlier version's hash added in, as {name, value, ...}.
local function all_counts(legacy, key)
  local values = {}
  local flat = redis.call('HGETALL', legacy)
  for i = 1, #flat, 2 do values[flat[i]] = tonumber(flat[i + 1]) or 0 end
  local args, names = counter_args('GET')
  local reply = redis.call('BITFIELD_RO', key, unpack(args))
  for i, name in ipairs(names) do values[name] = (values[name] or 0) + reply[i] end
  local out = {}
  for _, name in ipairs(names) do
    if name ~= 'seq' and values[name] ~= 0 then
      out[#out + 1] = name
      out[#out + 1] = values[name]
    end
  end
  return out
end
return {
  redis.call('ZCARD', ready),
  redis.call('ZCARD', delayed),
  redis.call('ZCARD', leases),
  redis.call('ZCARD', dead),
  redis.call('ZCOUNT', leases, '-inf', now_ms),
  oldest,
  now_ms,
  all_counts(stats, counters),
}
