#!lua flags=allow-oom
--[[
revive: an operator's requeue: messages back to the front of ready, from dead, delayed or leased.

Each id comes with the token the operator saw, or "*":
  "*"    revive only a message nobody holds (dead-lettered, delayed or ready);
         a leased message is refused as STALE, so a resent revive never takes
         a message back from the consumer that claimed it after the first one;
  token  compare-and-set: revive (even from a lease) only while the token is
         still that one, which fences off whoever held it.
The token is bumped either way; with reset = 1 the delivery count starts again
from zero (a dead-lettered message gets max_deliveries fresh attempts). Acked
messages are gone and report NOT_FOUND: requeue never resurrects finished work.

KEYS[1] dead   KEYS[2] reasons  KEYS[3] state  KEYS[4] ready  KEYS[5] seq
KEYS[6] signal KEYS[7] stats    KEYS[8] leases KEYS[9] delayed

ARGV[1] reset deliveries (0/1)   ARGV[2] signal cap   ARGV[3..] pairs: id, token (or "*")

Reply: one integer per pair: 1 OK, -1 NOT_FOUND, -2 STALE (held by a consumer, or the token moved on).
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>", "FENCED CORRUPT <id>".
--]]

local reset, signal_cap = ARGV[1] == '1', tonumber(ARGV[2])
if #KEYS ~= 9 or not signal_cap or #ARGV < 4 or #ARGV % 2 ~= 0 then
  error({err = 'FENCED BADARG revive needs 9 keys, reset flag, signal cap and id/token pairs'})
end
local types = {'zset', 'hash', 'hash', 'zset', 'string', 'list', 'hash', 'zset', 'zset'}
for i = 1, 9 do check_type(KEYS[i], types[i]) end

local states = {}
for i = 3, #ARGV, 2 do
  if ARGV[i + 1] ~= '*' and not tonumber(ARGV[i + 1]) then
    error({err = 'FENCED BADARG revive: token of ' .. ARGV[i] .. ' is neither a number nor *'})
  end
  local st = redis.call('HGET', KEYS[3], ARGV[i])
  if st then
    states[i] = parse_state(st)
    if not states[i] then error({err = 'FENCED CORRUPT ' .. ARGV[i]}) end
  end
end

local replies, revived = {}, 0
for i = 3, #ARGV, 2 do
  local id, expected = ARGV[i], ARGV[i + 1]
  local state = states[i]
  if not state then
    replies[#replies + 1] = -1
  elseif (expected == '*' and redis.call('ZSCORE', KEYS[8], id))
      or (expected ~= '*' and tonumber(expected) ~= state.token) then
    replies[#replies + 1] = -2
  else
    local deliveries = reset and 0 or state.deliveries
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('ZREM', KEYS[8], id)
    redis.call('ZREM', KEYS[9], id)
    redis.call('HSET', KEYS[3], id, string.format('%.0f', state.token + 1)
      .. '|' .. deliveries .. '|' .. state.priority .. '|' .. state.queued)
    local seq = redis.call('INCR', KEYS[5])
    redis.call('ZADD', KEYS[4], state.priority * 1e14 - seq, id)
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
