#!lua flags=allow-oom
--[[
revive: an operator's requeue: messages back to ready, from dead, leased or delayed.

The token is bumped so whoever held the message is fenced off; with
reset = 1 the delivery count starts again from zero (a dead-lettered message
gets max_deliveries fresh attempts). Acked messages are gone and report
NOT_FOUND: requeue never resurrects finished work.

KEYS[1] dead   KEYS[2] reasons  KEYS[3] state  KEYS[4] ready  KEYS[5] seq
KEYS[6] signal KEYS[7] stats    KEYS[8] leases KEYS[9] delayed

ARGV[1] reset deliveries (0/1)   ARGV[2] signal cap   ARGV[3..] ids

Reply: one integer per id: 1 OK, -1 NOT_FOUND.
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]

local function check_type(key, want)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= want then
    error({err = 'FENCED WRONGTYPE ' .. key .. ' is a ' .. t .. ', expected ' .. want})
  end
end

local reset, signal_cap = ARGV[1] == '1', tonumber(ARGV[2])
if #KEYS ~= 9 or not signal_cap or #ARGV < 3 then
  error({err = 'FENCED BADARG revive needs 9 keys, reset flag, signal cap and ids'})
end
local types = {'zset', 'hash', 'hash', 'zset', 'string', 'list', 'hash', 'zset', 'zset'}
for i = 1, 9 do check_type(KEYS[i], types[i]) end

local replies, revived = {}, 0
for i = 3, #ARGV do
  local id = ARGV[i]
  local st = redis.call('HGET', KEYS[3], id)
  if not st then
    replies[#replies + 1] = -1
  else
    local token, deliveries, priority, queued = string.match(st, '^(%d+)|(%d+)|(%d+)|(%d+)$')
    if reset then deliveries = 0 end
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('ZREM', KEYS[8], id)
    redis.call('ZREM', KEYS[9], id)
    redis.call('HSET', KEYS[3], id, string.format('%.0f', tonumber(token) + 1)
      .. '|' .. deliveries .. '|' .. priority .. '|' .. queued)
    local seq = redis.call('INCR', KEYS[5])
    redis.call('ZADD', KEYS[4], tonumber(priority) * 1e12 + seq, id)
    redis.call('LPUSH', KEYS[6], '1')
    replies[#replies + 1] = 1
    revived = revived + 1
  end
end
if revived > 0 then
  redis.call('LTRIM', KEYS[6], 0, signal_cap - 1)
  redis.call('HINCRBY', KEYS[7], 'revived', revived)
end
return replies
