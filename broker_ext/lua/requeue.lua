#!lua flags=allow-oom
--[[
requeue: hand deliveries back, to the front of their priority (or delayed).

Used for reject(requeue=True) (counted: the delivery is spent, and past
max_deliveries the message is dead-lettered instead) and for a consumer giving
back what it held at shutdown (not counted: the delivery never ran). The token
is kept, so the next claim fences this holder off; a delivery that is no longer
leased (a resent requeue, or one reclaimed meanwhile) is reported OK unchanged; ARGV[4] can raise it to a
floor (a token the database has already seen) so the next delivery outranks it.

KEYS[1] leases  KEYS[2] state  KEYS[3] ready  KEYS[4] delayed  KEYS[5] seq
KEYS[6] signal  KEYS[7] stats  KEYS[8] dead   KEYS[9] reasons

ARGV[1] max deliveries   ARGV[2] count the delivery (0/1)   ARGV[3] delay ms
ARGV[4] token floor (0: none)   ARGV[5] signal cap
ARGV[6..] pairs: id, token

Reply: one integer per pair:
   1 OK             requeued (ready, or delayed by ARGV[3])
   5 DEAD_LETTERED  out of deliveries: moved to the dead-letter set
  -1 NOT_FOUND      no such message
  -2 STALE          a newer delivery exists: nothing written
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]

local function check_type(key, want)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= want then
    error({err = 'FENCED WRONGTYPE ' .. key .. ' is a ' .. t .. ', expected ' .. want})
  end
end

local max_deliveries, counted = tonumber(ARGV[1]), ARGV[2] == '1'
local delay, floor, signal_cap = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if #KEYS ~= 9 or not max_deliveries or not delay or not floor or not signal_cap
    or #ARGV < 7 or #ARGV % 2 ~= 1 then
  error({err = 'FENCED BADARG requeue needs 9 keys, 5 numbers and id/token pairs'})
end
local types = {'zset', 'hash', 'zset', 'zset', 'string', 'list', 'hash', 'zset', 'hash'}
for i = 1, 9 do check_type(KEYS[i], types[i]) end

local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local replies, requeued, dead = {}, 0, 0
for i = 6, #ARGV, 2 do
  local id, token = ARGV[i], ARGV[i + 1]
  local st = redis.call('HGET', KEYS[2], id)
  local current, deliveries, priority, queued
  if st then
    current, deliveries, priority, queued = string.match(st, '^(%d+)|(%d+)|(%d+)|(%d+)$')
  end
  if not st then
    replies[#replies + 1] = -1
  elseif current ~= token then
    replies[#replies + 1] = -2
  elseif not redis.call('ZSCORE', KEYS[1], id) then
    -- Not leased: already requeued (a resent call) or reclaimed. Nothing to give back.
    replies[#replies + 1] = 1
  else
    deliveries = tonumber(deliveries)
    if not counted and deliveries > 0 then deliveries = deliveries - 1 end
    local next_token = math.max(tonumber(current), floor)
    redis.call('ZREM', KEYS[1], id)
    if counted and deliveries >= max_deliveries then
      next_token = next_token + 1
      redis.call('ZREM', KEYS[3], id)
      redis.call('ZREM', KEYS[4], id)
      redis.call('ZADD', KEYS[8], now_ms, id)
      redis.call('HSET', KEYS[9], id, cjson.encode({
        reason = 'rejected and requeued ' .. deliveries .. ' times (max_deliveries ' .. max_deliveries .. ')',
        at_ms = now_ms, deliveries = deliveries}))
      replies[#replies + 1] = 5
      dead = dead + 1
    else
      if delay > 0 then
        redis.call('ZADD', KEYS[4], now_ms + delay, id)
      else
        local seq = redis.call('INCR', KEYS[5])
        redis.call('ZADD', KEYS[3], tonumber(priority) * 1e12 - seq, id)
        redis.call('LPUSH', KEYS[6], '1')
      end
      replies[#replies + 1] = 1
      requeued = requeued + 1
    end
    redis.call('HSET', KEYS[2], id,
      string.format('%.0f', next_token) .. '|' .. deliveries .. '|' .. priority .. '|' .. queued)
  end
end
redis.call('LTRIM', KEYS[6], 0, signal_cap - 1)
if requeued > 0 then redis.call('HINCRBY', KEYS[7], 'requeued', requeued) end
if dead > 0 then redis.call('HINCRBY', KEYS[7], 'dead_lettered', dead) end
return replies
