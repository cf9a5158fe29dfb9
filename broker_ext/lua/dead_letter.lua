#!lua flags=allow-oom
--[[
dead_letter: move messages to the queue's dead-letter set, with a reason.

For reject(requeue=False), a body that cannot be decoded, an unknown task, an
oversized payload. The body and state are kept so an operator can inspect and
revive the message; the token is bumped so the former holder is fenced off.
A token and claim of "*" skip the fencing check (an operator's action).

KEYS[1] leases   zset
KEYS[2] state    hash
KEYS[3] ready    zset
KEYS[4] delayed  zset
KEYS[5] dead     zset
KEYS[6] reasons  hash
KEYS[7] counters string  (lua/include/counters.lua)

ARGV[1] reason (text)
ARGV[2] queue ttl ms (0: the queue does not expire)
ARGV[3..] triples: id, token, claim (or "*", "*")

Reply: one integer per triple:
   5 DEAD_LETTERED  in the dead-letter set (now, or by a call before: a resent call)
  -1 NOT_FOUND      no such message
  -2 STALE          another delivery is the current one: nothing written
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>", "FENCED CORRUPT <id>".
--]]
--- @include "check_types"
--- @include "arg_int"
--- @include "server_time"
--- @include "state"
--- @include "set_dead"
--- @include "counters"
--- @include "keep_expiry"
local leases, state, ready, delayed, dead, reasons, counters =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
if #KEYS ~= 7 or #ARGV < 5 or (#ARGV - 2) % 3 ~= 0 then
  error({err = 'FENCED BADARG dead_letter needs 7 keys, a reason, a ttl and id/token/claim triples'})
end
local reason = ARGV[1]
local ttl = arg_int(ARGV[2], 'queue ttl', 0, 1e12)
check_types({{leases, 'zset'}, {state, 'hash'}, {ready, 'zset'}, {delayed, 'zset'}, {dead, 'zset'},
             {reasons, 'hash'}, {counters, 'string'}})

-- Read and check every message before the first write.
local found = {}
for i = 3, #ARGV, 3 do
  local raw = redis.call('HGET', state, ARGV[i])
  found[i] = raw and parse_state(raw) or false
  if raw and not found[i] then error({err = 'FENCED CORRUPT ' .. ARGV[i]}) end
end

local now_ms = server_time()
local replies, moved = {}, 0
for i = 3, #ARGV, 3 do
  local id, token, claim = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local s = found[i]
  if not s then
    replies[#replies + 1] = -1
  elseif redis.call('ZSCORE', dead, id) then
    replies[#replies + 1] = 5
  elseif token ~= '*' and (string.format('%.0f', s.token) ~= token or s.claim ~= claim) then
    replies[#replies + 1] = -2
  else
    redis.call('ZREM', leases, id)
    redis.call('ZREM', ready, id)
    redis.call('ZREM', delayed, id)
    s.token = s.token + 1
    redis.call('HSET', state, id, format_state(s))
    set_dead(dead, reasons, id, now_ms, reason, s.deliveries)
    replies[#replies + 1] = 5
    moved = moved + 1
  end
end
if moved > 0 then
  add_counts(counters, {dead_lettered = moved})
  keep_expiry(ttl, {state, dead, reasons, counters})
end
return replies
