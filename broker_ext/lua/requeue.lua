#!lua flags=allow-oom
--[[
requeue: hand deliveries back, to the front of their priority (or delayed).

Used for reject(requeue=True) (counted: the delivery is spent, and past
max_deliveries the message is dead-lettered instead), for a consumer giving
back what it held at shutdown (not counted: the delivery never ran), and for
a delivery the exactly-once layer defers (ARGV[4]: a token floor, the highest
token the database has seen, so the next delivery outranks it).

Giving a delivery back ends it: the token moves to max(token + 1, floor), so
the former holder's late ack, extend or reject is refused as STALE. This
holds also when the lease had already lapsed and the message was reclaimed
but not claimed again: the floor and the delay still apply.

A resent requeue (its token was moved by the first one, and the message is
not leased) is recognised and reported OK without writing.

KEYS[1] leases  KEYS[2] state  KEYS[3] ready  KEYS[4] delayed  KEYS[5] seq
KEYS[6] signal  KEYS[7] stats  KEYS[8] dead   KEYS[9] reasons

ARGV[1] max deliveries   ARGV[2] count the delivery (0/1)   ARGV[3] delay ms
ARGV[4] token floor (0: none)   ARGV[5] signal cap
ARGV[6] why the delivery is given back, for the dead-letter reason ('' : rejected by the consumer)
ARGV[7..] pairs: id, token

Reply: one integer per pair:
   1 OK             requeued (ready, or delayed by ARGV[3]), or a resent call
   5 DEAD_LETTERED  out of deliveries: moved to the dead-letter set
  -1 NOT_FOUND      no such message
  -2 STALE          a newer delivery exists: nothing written
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>",
"FENCED CORRUPT <id>" (a state that is not "token|deliveries|priority|queued_ms").
--]]

local max_deliveries, counted = tonumber(ARGV[1]), ARGV[2] == '1'
local delay, floor, signal_cap = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local why = ARGV[6] ~= '' and ARGV[6] or 'rejected'
if #KEYS ~= 9 or not max_deliveries or not delay or not floor or not signal_cap
    or #ARGV < 8 or #ARGV % 2 ~= 0 then
  error({err = 'FENCED BADARG requeue needs 9 keys, 5 numbers, a reason and id/token pairs'})
end
local types = {'zset', 'hash', 'zset', 'zset', 'string', 'list', 'hash', 'zset', 'hash'}
for i = 1, 9 do check_type(KEYS[i], types[i]) end

-- Read and check every message before the first write.
local states = {}
for i = 7, #ARGV, 2 do
  if not tonumber(ARGV[i + 1]) then
    error({err = 'FENCED BADARG requeue: token of ' .. ARGV[i] .. ' is not a number'})
  end
  local st = redis.call('HGET', KEYS[2], ARGV[i])
  if st then
    states[i] = parse_state(st)
    if not states[i] then error({err = 'FENCED CORRUPT ' .. ARGV[i]}) end
  end
end

local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local replies, requeued, dead = {}, 0, 0
for i = 7, #ARGV, 2 do
  local id, token = ARGV[i], tonumber(ARGV[i + 1])
  local state = states[i]
  local leased = state and redis.call('ZSCORE', KEYS[1], id)
  if not state then
    replies[#replies + 1] = -1
  elseif state.token ~= token then
    local resent = not leased and state.token == math.max(token + 1, floor)
    if not resent then
      replies[#replies + 1] = -2
    else
      replies[#replies + 1] = redis.call('ZSCORE', KEYS[8], id) and 5 or 1
    end
  else
    local deliveries = state.deliveries
    if not counted and deliveries > 0 then deliveries = deliveries - 1 end
    local next_token = string.format('%.0f', math.max(state.token + 1, floor))
    redis.call('ZREM', KEYS[1], id)
    redis.call('ZREM', KEYS[3], id)
    redis.call('ZREM', KEYS[4], id)
    if counted and deliveries >= max_deliveries then
      redis.call('ZADD', KEYS[8], now_ms, id)
      redis.call('HSET', KEYS[9], id, cjson.encode({
        reason = why .. ': given back ' .. deliveries .. ' times (max_deliveries ' .. max_deliveries .. ')',
        at_ms = now_ms, deliveries = deliveries}))
      replies[#replies + 1] = 5
      dead = dead + 1
    else
      if delay > 0 then
        redis.call('ZADD', KEYS[4], now_ms + delay, id)
      else
        local seq = redis.call('INCR', KEYS[5])
        redis.call('ZADD', KEYS[3], state.priority * 1e14 - seq, id)
        redis.call('LPUSH', KEYS[6], '1')
      end
      replies[#replies + 1] = 1
      requeued = requeued + 1
    end
    redis.call('HSET', KEYS[2], id, next_token .. '|' .. deliveries .. '|' .. state.priority .. '|' .. state.queued)
  end
end
redis.call('LTRIM', KEYS[6], 0, signal_cap - 1)
if requeued > 0 then redis.call('HINCRBY', KEYS[7], 'requeued', requeued) end
if dead > 0 then redis.call('HINCRBY', KEYS[7], 'dead_lettered', dead) end
return replies
