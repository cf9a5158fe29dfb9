#!lua flags=allow-oom
--[[
purge: delete up to N ready messages (Celery's `purge`); leased, delayed and
dead messages are left alone.

KEYS[1] ready  KEYS[2] bodies  KEYS[3] state  KEYS[4] stats
ARGV[1] limit (messages per call; call again while the reply equals it)

Reply: the number of messages deleted.
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]

local limit = tonumber(ARGV[1])
if #KEYS ~= 4 or not limit or limit < 1 then
  error({err = 'FENCED BADARG purge needs 4 keys and a limit >= 1'})
end
local types = {'zset', 'hash', 'hash', 'hash'}
for i = 1, 4 do check_type(KEYS[i], types[i]) end

local popped = redis.call('ZPOPMIN', KEYS[1], limit)
for i = 1, #popped, 2 do
  redis.call('HDEL', KEYS[2], popped[i])
  redis.call('HDEL', KEYS[3], popped[i])
end
local purged = #popped / 2
if purged > 0 then redis.call('HINCRBY', KEYS[4], 'purged', purged) end
return purged
