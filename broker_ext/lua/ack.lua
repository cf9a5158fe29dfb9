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

The same acks travel in a consumer's next claim (claim.lua); both take them
from lua/include/finish.lua. One ack, the common call, checks no key's type up
front (a TYPE each): its reads come first and its writes refuse a key of the
wrong type with nothing written (lua/include/guard.lua); several acks in one
call check their keys' types once (TYPE). Acked ids older than the done window
are forgotten every 32 acks of the queue, a bounded number each time.

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
Errors (nothing written): "FENCED WRONGTYPE <key>: ...", "FENCED BADARG <what>", "FENCED CORRUPT <id>".
--]]
--- @include "guard"
--- @include "arg_int"
--- @include "server_time"
--- @include "finish"
--- @include "keep_expiry"
local leases, state, bodies, done, acks, ready, delayed, counters =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
if #KEYS ~= 8 or #ARGV < 5 or (#ARGV - 2) % 3 ~= 0 then
  error({err = 'FENCED BADARG ack needs 8 keys, a window, a ttl and id/token/claim triples'})
end
local k = {leases = leases, state = state, bodies = bodies, done = done, acks = acks, ready = ready,
           delayed = delayed, window = arg_int(ARGV[1], 'done window', 0, 1e12)}
local ttl = arg_int(ARGV[2], 'queue ttl', 0, 1e12)

-- Read and decide every ack before the first write.
local plan = finish_read(k, ARGV, 3)
if #plan.current == 0 then return plan.replies end
local now_ms = server_time()
if not plan.checked then guarded(nil, 'HLEN', bodies) end

-- The writes whose keys may still be of the wrong type (each undone exactly on a refusal), leases last.
local totals = add_counts_guarded(counters, {acked = #plan.current})
finish_records(k, plan, now_ms)
finish_unlease(k, plan)
finish_write(k, plan)
finish_prune(k, now_ms, totals.acked, #plan.current)
if k.window > 0 then keep_expiry(ttl, {done, acks}) end
return plan.replies
