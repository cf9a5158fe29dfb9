#!lua flags=allow-oom
--[[
extend: push the lease deadlines of live deliveries to server time + lease.

Only a current delivery (its token and claim are the message's) extends. A
delivery whose lease had expired and that went back to ready (or delayed) but
was not claimed again is still current: its holder is alive, so extend takes
it back under lease rather than let it run twice.

KEYS[1] leases   zset
KEYS[2] state    hash
KEYS[3] ready    zset
KEYS[4] delayed  zset

ARGV[1] lease ms   ARGV[2] queue ttl ms (0: the queue does not expire)
ARGV[3..] triples: id, token, claim

Reply: one integer per triple:
   1 OK         lease extended (or taken back)
  -1 NOT_FOUND  no such message (acked or dead-lettered)
  -2 STALE      another delivery is the current one: nothing written
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>", "FENCED CORRUPT <id>".
--]]
--- @include "check_types"
--- @include "arg_int"
--- @include "server_time"
--- @include "state"
--- @include "keep_expiry"
local leases, state, ready, delayed = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if #KEYS ~= 4 or #ARGV < 5 or (#ARGV - 2) % 3 ~= 0 then
  error({err = 'FENCED BADARG extend needs 4 keys, a lease, a ttl and id/token/claim triples'})
end
local lease = arg_int(ARGV[1], 'lease ms', 1, 1e12)
local ttl = arg_int(ARGV[2], 'queue ttl', 0, 1e12)
check_types({{leases, 'zset'}, {state, 'hash'}, {ready, 'zset'}, {delayed, 'zset'}})

local found = {}
for i = 3, #ARGV, 3 do
  local raw = redis.call('HGET', state, ARGV[i])
  found[i] = raw and parse_state(raw) or false
  if raw and not found[i] then error({err = 'FENCED CORRUPT ' .. ARGV[i]}) end
end

local now_ms = server_time()
local replies, extended = {}, 0
for i = 3, #ARGV, 3 do
  local id, token, claim = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local s = found[i]
  if not s then
    replies[#replies + 1] = -1
  elseif string.format('%.0f', s.token) ~= token or s.claim ~= claim then
    replies[#replies + 1] = -2
  else
    redis.call('ZREM', ready, id)
    redis.call('ZREM', delayed, id)
    redis.call('ZADD', leases, now_ms + lease, id)
    replies[#replies + 1] = 1
    extended = extended + 1
  end
end
if extended > 0 then keep_expiry(ttl, {leases}) end
return replies
