#!lua flags=allow-oom
--[[
purge: delete up to N ready messages (Celery's `purge`); leased, delayed and
dead messages are left alone.

KEYS[1] ready   zset
KEYS[2] bodies  hash
KEYS[3] state   hash
KEYS[4] counters string  (lua/include/counters.lua)

ARGV[1] limit (messages per call; call again while the reply equals it)

Reply: the number of messages deleted.
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]
--- @include "check_types"
--- @include "arg_int"
--- @include "counters"
local ready, bodies, state, counters = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if #KEYS ~= 4 or #ARGV ~= 1 then error({err = 'FENCED BADARG purge needs 4 keys and a limit'}) end
local limit = arg_int(ARGV[1], 'limit', 1, 100000)
check_types({{ready, 'zset'}, {bodies, 'hash'}, {state, 'hash'}, {counters, 'string'}})

local popped = redis.call('ZPOPMIN', ready, limit)
for i = 1, #popped, 2 do
  redis.call('HDEL', bodies, popped[i])
  redis.call('HDEL', state, popped[i])
end
local purged = #popped / 2
add_counts(counters, {purged = purged})
return purged
