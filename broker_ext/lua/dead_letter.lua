#!lua flags=allow-oom
--[[
dead_letter: move messages to the queue's dead-letter set, with a reason.

For reject(requeue=False), a body that cannot be decoded, an unknown task, an
oversized payload. The body and state are kept so an operator can inspect and
revive the message; the token is bumped so the former holder is fenced off.
A token of "*" skips the fencing check (operator action from the admin).

KEYS[1] leases  KEYS[2] state  KEYS[3] ready  KEYS[4] delayed
KEYS[5] dead    KEYS[6] reasons  KEYS[7] stats

ARGV[1] reason (text)
ARGV[2..] pairs: id, token (or "*")

Reply: one integer per pair:
   5 DEAD_LETTERED  moved to the dead-letter set
  -1 NOT_FOUND      no such message
  -2 STALE          a newer delivery exists: nothing written
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>", "FENCED CORRUPT <id>".
--]]

if #KEYS ~= 7 or #ARGV < 3 or #ARGV % 2 ~= 1 then
  error({err = 'FENCED BADARG dead_letter needs 7 keys, a reason and id/token pairs'})
end
local types = {'zset', 'hash', 'zset', 'zset', 'zset', 'hash', 'hash'}
for i = 1, 7 do check_type(KEYS[i], types[i]) end

-- Read and check every message before the first write.
local parsed = {}
for i = 2, #ARGV, 2 do
  local st = redis.call('HGET', KEYS[2], ARGV[i])
  if st then
    local current, deliveries, rest = string.match(st, '^(%d+)|(%d+)(|%d|%d+)$')
    if not current then error({err = 'FENCED CORRUPT ' .. ARGV[i]}) end
    parsed[i] = {token = current, deliveries = tonumber(deliveries), rest = '|' .. deliveries .. rest}
  end
end

local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local replies, dead = {}, 0
for i = 2, #ARGV, 2 do
  local id, token = ARGV[i], ARGV[i + 1]
  local state = parsed[i]
  if not state then
    replies[#replies + 1] = -1
  elseif redis.call('ZSCORE', KEYS[5], id) then
    replies[#replies + 1] = 5  -- already dead-lettered (a resent call): nothing to do
  elseif token ~= '*' and state.token ~= token then
    replies[#replies + 1] = -2
  else
    redis.call('ZREM', KEYS[1], id)
    redis.call('ZREM', KEYS[3], id)
    redis.call('ZREM', KEYS[4], id)
    redis.call('ZADD', KEYS[5], now_ms, id)
    redis.call('HSET', KEYS[2], id, string.format('%.0f', tonumber(state.token) + 1) .. state.rest)
    redis.call('HSET', KEYS[6], id, cjson.encode({reason = ARGV[1], at_ms = now_ms, deliveries = state.deliveries}))
    replies[#replies + 1] = 5
    dead = dead + 1
  end
end
if dead > 0 then redis.call('HINCRBY', KEYS[7], 'dead_lettered', dead) end
return replies
