#!lua flags=allow-oom
--[[
ack: finish deliveries whose fencing token is still current.

A current token removes the message everywhere (leases, ready, delayed, body,
state), even when its lease had expired and it was waiting to be redelivered:
nobody holds a newer delivery, so the work is done and must not run again.
A token that is not current is refused as STALE and changes nothing (not even
a counter: the refusing caller logs it). An id
acked before (a resent ack) is reported ALREADY_ACKED while it is in the done
window.

KEYS[1] leases  KEYS[2] state  KEYS[3] bodies  KEYS[4] done
KEYS[5] ready   KEYS[6] delayed  KEYS[7] stats

ARGV[1] done window ms (0: keep no record of acked ids)
ARGV[2..] pairs: id, token

Reply: one integer per pair:
   1 OK             acked now
   2 ALREADY_ACKED  acked before (resent ack)
  -1 NOT_FOUND      no such message
  -2 STALE          a newer delivery exists: nothing written
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]

local window = tonumber(ARGV[1])
if #KEYS ~= 7 or not window or #ARGV < 3 or #ARGV % 2 ~= 1 then
  error({err = 'FENCED BADARG ack needs 7 keys, a window and id/token pairs'})
end
local types = {'zset', 'hash', 'hash', 'zset', 'zset', 'zset', 'hash'}
for i = 1, 7 do check_type(KEYS[i], types[i]) end

local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local replies, acked = {}, 0
for i = 2, #ARGV, 2 do
  local id, token = ARGV[i], ARGV[i + 1]
  local st = redis.call('HGET', KEYS[2], id)
  if not st then
    replies[#replies + 1] = redis.call('ZSCORE', KEYS[4], id) and 2 or -1
  elseif string.match(st, '^(%d+)|') ~= token then
    replies[#replies + 1] = -2
  else
    redis.call('ZREM', KEYS[1], id)
    redis.call('ZREM', KEYS[5], id)
    redis.call('ZREM', KEYS[6], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
    if window > 0 then redis.call('ZADD', KEYS[4], now_ms, id) end
    replies[#replies + 1] = 1
    acked = acked + 1
  end
end
if window > 0 and acked > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now_ms - window)
end
if acked > 0 then redis.call('HINCRBY', KEYS[7], 'acked', acked) end
return replies
