#!lua flags=allow-oom
--[[
ack: finish deliveries that are still current: their token and claim are the message's.

A current delivery removes the message everywhere (leases, ready, delayed,
body, state), even when its lease had expired and it was waiting to be
redelivered: nobody holds a newer delivery, so the work is done and must not
run again. Anything else is refused and changes nothing (not even a counter:
the refusing caller logs it). For the done window, the broker remembers which
delivery acked each message, so that a resent ack of that delivery is
ALREADY_ACKED while a late ack of another delivery of it is STALE.

KEYS[1] leases   zset
KEYS[2] state    hash
KEYS[3] bodies   hash
KEYS[4] done     zset  acked id -> acked at ms
KEYS[5] acks     hash  acked id -> "token|claim|publish ids": the delivery that acked it, and the
                       publishes of its id (lua/include/publish_ids.lua), which a resend still meets
KEYS[6] ready    zset
KEYS[7] delayed  zset
KEYS[8] counters string  (lua/include/counters.lua)

ARGV[1] done window ms (0: keep no record of acked ids)
ARGV[2] queue ttl ms (0: the queue does not expire)
ARGV[3..] triples: id, token, claim

Reply: one integer per triple:
   1 OK             acked now
   2 ALREADY_ACKED  this delivery acked it before (a resent ack)
  -1 NOT_FOUND      no such message (or acked longer ago than the done window)
  -2 STALE          another delivery is (or was) the current one: nothing written
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>", "FENCED CORRUPT <id>".
--]]
--- @include "check_types"
--- @include "arg_int"
--- @include "server_time"
--- @include "state"
--- @include "counters"
--- @include "keep_expiry"
local leases, state, bodies, done, acks, ready, delayed, counters =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
if #KEYS ~= 8 or #ARGV < 5 or (#ARGV - 2) % 3 ~= 0 then
  error({err = 'FENCED BADARG ack needs 8 keys, a window, a ttl and id/token/claim triples'})
end
local window = arg_int(ARGV[1], 'done window', 0, 1e12)
local ttl = arg_int(ARGV[2], 'queue ttl', 0, 1e12)
check_types({{leases, 'zset'}, {state, 'hash'}, {bodies, 'hash'}, {done, 'zset'}, {acks, 'hash'},
             {ready, 'zset'}, {delayed, 'zset'}, {counters, 'string'}})

-- Read and check every message before the first write.
local found = {}
for i = 3, #ARGV, 3 do
  local raw = redis.call('HGET', state, ARGV[i])
  if raw then
    found[i] = parse_state(raw)
    if not found[i] then error({err = 'FENCED CORRUPT ' .. ARGV[i]}) end
  else
    found[i] = false
  end
end

local now_ms = server_time()
local replies, acked = {}, 0
for i = 3, #ARGV, 3 do
  local id, token, claim = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local s = found[i]
  if not s then
    local by = redis.call('HGET', acks, id)
    if not by then
      replies[#replies + 1] = -1
    elseif string.match(by, '^[^|]*|[^|]*') == token .. '|' .. claim then
      replies[#replies + 1] = 2
    else
      replies[#replies + 1] = -2
    end
  elseif string.format('%.0f', s.token) ~= token or s.claim ~= claim then
    replies[#replies + 1] = -2
  else
    redis.call('ZREM', leases, id)
    redis.call('ZREM', ready, id)
    redis.call('ZREM', delayed, id)
    redis.call('HDEL', state, id)
    redis.call('HDEL', bodies, id)
    if window > 0 then
      redis.call('ZADD', done, now_ms, id)
      redis.call('HSET', acks, id, token .. '|' .. claim .. '|' .. s.publish_ids)
    end
    replies[#replies + 1] = 1
    acked = acked + 1
  end
end
if acked > 0 then
  if window > 0 then
    -- Forget acks older than the window, a bounded number per call.
    local old = redis.call('ZRANGE', done, '-inf', now_ms - window, 'BYSCORE', 'LIMIT', 0, 2 * acked + 10)
    if #old > 0 then
      redis.call('ZREM', done, unpack(old))
      redis.call('HDEL', acks, unpack(old))
    end
    keep_expiry(ttl, {done, acks})
  end
  add_counts(counters, {acked = acked})
end
return replies
