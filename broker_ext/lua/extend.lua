#!lua flags=allow-oom
--[[
extend: push the lease deadlines of live deliveries to server time + lease.

Only a current token extends. A delivery whose lease had expired and that went
back to ready (or delayed) but was not claimed again is still current: its
holder is alive, so extend takes it back under lease rather than let it run
twice.

KEYS[1] leases  KEYS[2] state  KEYS[3] ready  KEYS[4] delayed

ARGV[1] lease ms
ARGV[2..] pairs: id, token

Reply: one integer per pair:
   1 OK         lease extended (or taken back)
  -1 NOT_FOUND  no such message (acked or dead-lettered)
  -2 STALE      a newer delivery exists: nothing written
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]

local lease = tonumber(ARGV[1])
if #KEYS ~= 4 or not lease or lease <= 0 or #ARGV < 3 or #ARGV % 2 ~= 1 then
  error({err = 'FENCED BADARG extend needs 4 keys, a lease > 0 and id/token pairs'})
end
local types = {'zset', 'hash', 'zset', 'zset'}
for i = 1, 4 do check_type(KEYS[i], types[i]) end

local now = redis.call('TIME')
local deadline = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) + lease
local replies = {}
for i = 2, #ARGV, 2 do
  local id, token = ARGV[i], ARGV[i + 1]
  local st = redis.call('HGET', KEYS[2], id)
  if not st then
    replies[#replies + 1] = -1
  elseif string.match(st, '^(%d+)|') ~= token then
    replies[#replies + 1] = -2
  else
    redis.call('ZREM', KEYS[3], id)
    redis.call('ZREM', KEYS[4], id)
    redis.call('ZADD', KEYS[1], deadline, id)
    replies[#replies + 1] = 1
  end
end
return replies
