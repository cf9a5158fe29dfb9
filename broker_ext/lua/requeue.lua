#!lua flags=allow-oom
--[[
requeue: hand deliveries back, ending them, to ready (or delayed).

Used for reject(requeue=True) (counted: the delivery is spent against
max_deliveries, past which the message is dead-lettered instead; it goes to
the back of its priority, as Kombu's redis:// requeues it), for a consumer
giving back what it held at shutdown (not counted: the delivery never ran;
to the front, as Kombu restores it), and for a delivery the exactly-once
layer defers (ARGV[4]: a token floor, the highest token the database has
seen, so the next delivery outranks it; ARGV[3]: a delay).

Giving a delivery back ends it: the token moves to max(token + 1, floor), so
the former holder's late ack, extend or reject is refused as STALE. This
holds also when the lease had already lapsed and the message was reclaimed
but not claimed again: the floor and the delay still apply.

A resent requeue (the first one moved the token, kept the claim, and nobody
claimed the message since) is recognised and reported as the first was,
without writing.

Every delivery given back is logged to `requeues` (capped at 1,000, JSON:
id, the token and claim it ended, its delivery count, counted, delay, floor,
the reason, server time), so ops can say why a message came again.

KEYS[1] leases   zset
KEYS[2] state    hash
KEYS[3] ready    zset
KEYS[4] delayed  zset
KEYS[5] seq      string  the sequence an earlier version kept (read once, when the counters start)
KEYS[6] wake     zset
KEYS[7] counters string  (lua/include/counters.lua)
KEYS[8] dead     zset
KEYS[9] reasons  hash
KEYS[10] requeues list

ARGV[1] max deliveries   ARGV[2] count the delivery (0/1)   ARGV[3] delay ms
ARGV[4] token floor (0: none)
ARGV[5] why the delivery is given back, for the dead-letter reason ('': rejected by the consumer)
ARGV[6] queue ttl ms (0: the queue does not expire)
ARGV[7..] triples: id, token, claim

Reply: one integer per triple:
   1 OK             requeued (ready, or delayed by ARGV[3]), or a resent call
   5 DEAD_LETTERED  out of deliveries: moved to the dead-letter set
  -1 NOT_FOUND      no such message
  -2 STALE          another delivery is the current one: nothing written
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>", "FENCED CORRUPT <id>".
--]]
--- @include "check_types"
--- @include "arg_int"
--- @include "server_time"
--- @include "state"
--- @include "ready"
--- @include "wake"
--- @include "set_dead"
--- @include "keep_expiry"
local leases, state, ready, delayed, seq, wake_key, counters, dead, reasons, requeues =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
if #KEYS ~= 10 or #ARGV < 9 or (#ARGV - 6) % 3 ~= 0 then
  error({err = 'FENCED BADARG requeue needs 10 keys, 4 numbers, a reason, a ttl and id/token/claim triples'})
end
local max_deliveries = arg_int(ARGV[1], 'max deliveries', 1, 1e9)
local counted = arg_int(ARGV[2], 'counted', 0, 1) == 1
local delay = arg_int(ARGV[3], 'delay ms', 0, 1e12)
local floor = arg_int(ARGV[4], 'token floor', 0, 2 ^ 53)
local why = ARGV[5] ~= '' and ARGV[5] or 'rejected'
local ttl = arg_int(ARGV[6], 'queue ttl', 0, 1e12)
check_types({{leases, 'zset'}, {state, 'hash'}, {ready, 'zset'}, {delayed, 'zset'},
             {wake_key, 'zset'}, {counters, 'string'}, {dead, 'zset'}, {reasons, 'hash'}, {requeues, 'list'}})

-- Read and check every message before the first write.
local found = {}
for i = 7, #ARGV, 3 do
  arg_int(ARGV[i + 1], 'token of ' .. ARGV[i], 0, 2 ^ 53)
  local raw = redis.call('HGET', state, ARGV[i])
  found[i] = raw and parse_state(raw) or false
  if raw and not found[i] then error({err = 'FENCED CORRUPT ' .. ARGV[i]}) end
end

local now_ms = server_time()
local replies, requeued, moved = {}, 0, 0
for i = 7, #ARGV, 3 do
  local id, token, claim = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  local s = found[i]
  if not s then
    replies[#replies + 1] = -1
  elseif s.token ~= token or s.claim ~= claim then
    local resent = s.claim == claim and s.token == math.max(token + 1, floor)
      and not redis.call('ZSCORE', leases, id)
    if not resent then
      replies[#replies + 1] = -2
    else
      replies[#replies + 1] = redis.call('ZSCORE', dead, id) and 5 or 1
    end
  else
    redis.call('LPUSH', requeues, cjson.encode({id = id, token = string.format('%.0f', s.token), claim = s.claim,
      deliveries = s.deliveries, counted = counted, delay_ms = delay, floor = string.format('%.0f', floor),
      reason = ARGV[5], at_ms = now_ms}))
    s.token = math.max(s.token + 1, floor)
    if counted then s.charged = s.charged + 1 end
    redis.call('ZREM', leases, id)
    redis.call('ZREM', ready, id)
    redis.call('ZREM', delayed, id)
    if counted and s.charged >= max_deliveries then
      set_dead(dead, reasons, id, now_ms, why .. ': given back ' .. s.charged .. ' times (max_deliveries '
        .. max_deliveries .. ')', s.deliveries)
      replies[#replies + 1] = 5
      moved = moved + 1
    else
      if delay > 0 then
        redis.call('ZADD', delayed, now_ms + delay, id)
      else
        make_ready(ready, counters, seq, id, s.priority, not counted)
        wake(wake_key)
      end
      replies[#replies + 1] = 1
      requeued = requeued + 1
    end
    redis.call('HSET', state, id, format_state(s))
  end
end
add_counts(counters, {requeued = requeued, dead_lettered = moved})
if requeued + moved > 0 then
  redis.call('LTRIM', requeues, 0, 999)
  keep_expiry(ttl, {state, ready, delayed, wake_key, counters, dead, reasons, requeues})
end
return replies
