#!lua flags=allow-oom
--[[
revive: an operator's requeue: messages back to the front of ready, from dead, delayed or leased.

Each id comes with the delivery the operator saw (token and claim), or "*", "*":
  "*"    revive only a message nobody holds (dead-lettered, delayed or ready);
         a leased message is refused as STALE, so a resent revive never takes
         a message back from the consumer that claimed it after the first one;
  token  compare-and-set: revive (even from a lease) only while the token and
         claim are still those, which fences off whoever held it.
The token is bumped either way; with reset = 1 the charged deliveries and
interruptions start again from zero (a dead-lettered message gets
max_deliveries fresh attempts). Acked messages are gone and report NOT_FOUND:
requeue never resurrects finished work.

KEYS[1] dead     zset
KEYS[2] reasons  hash
KEYS[3] state    hash
KEYS[4] ready    zset
KEYS[5] seq      string  the sequence an earlier version kept (read once, when the counters start)
KEYS[6] wake     zset
KEYS[7] counters string  (lua/include/counters.lua)
KEYS[8] leases   zset
KEYS[9] delayed  zset

ARGV[1] reset deliveries (0/1)   ARGV[2] queue ttl ms (0: the queue does not expire)
ARGV[3..] triples: id, token, claim (or "*", "*")

Reply: one integer per triple: 1 OK, -1 NOT_FOUND, -2 STALE (held by a consumer, or the delivery moved on).
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>", "FENCED CORRUPT <id>".
--]]
--- @include "check_types"
--- @include "arg_int"
--- @include "state"
--- @include "ready"
--- @include "wake"
--- @include "keep_expiry"
local dead, reasons, state, ready, seq, wake_key, counters, leases, delayed =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9]
if #KEYS ~= 9 or #ARGV < 5 or (#ARGV - 2) % 3 ~= 0 then
  error({err = 'FENCED BADARG revive needs 9 keys, a reset flag, a ttl and id/token/claim triples'})
end
local reset = arg_int(ARGV[1], 'reset', 0, 1) == 1
local ttl = arg_int(ARGV[2], 'queue ttl', 0, 1e12)
check_types({{dead, 'zset'}, {reasons, 'hash'}, {state, 'hash'}, {ready, 'zset'},
             {wake_key, 'zset'}, {counters, 'string'}, {leases, 'zset'}, {delayed, 'zset'}})

local found = {}
for i = 3, #ARGV, 3 do
  if ARGV[i + 1] ~= '*' then arg_int(ARGV[i + 1], 'token of ' .. ARGV[i], 0, 2 ^ 53) end
  local raw = redis.call('HGET', state, ARGV[i])
  found[i] = raw and parse_state(raw) or false
  if raw and not found[i] then error({err = 'FENCED CORRUPT ' .. ARGV[i]}) end
end

local replies, revived = {}, 0
for i = 3, #ARGV, 3 do
  local id, token, claim = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local s = found[i]
  if not s then
    replies[#replies + 1] = -1
  elseif (token == '*' and redis.call('ZSCORE', leases, id))
      or (token ~= '*' and (tonumber(token) ~= s.token or claim ~= s.claim)) then
    replies[#replies + 1] = -2
  else
    if reset then
      s.charged, s.interrupted = 0, 0
    end
    s.token = s.token + 1
    redis.call('ZREM', dead, id)
    redis.call('HDEL', reasons, id)
    redis.call('ZREM', leases, id)
    redis.call('ZREM', delayed, id)
    redis.call('HSET', state, id, format_state(s))
    make_ready(ready, counters, seq, id, s.priority, true)
    replies[#replies + 1] = 1
    revived = revived + 1
  end
end
if revived > 0 then
  wake(wake_key)
  add_counts(counters, {revived = revived})
  keep_expiry(ttl, {state, ready, wake_key, counters})
end
return replies
