#!lua flags=allow-oom
--[[
reclaim: return deliveries whose lease has expired (by server time) to ready.

What every claim does first, on its own, for when no consumer is claiming
(the lease keepers of busy consumers, the `reclaim` command). A reclaimed
message goes to the front of its priority; its token and claim are kept, so
the next claim fences the old holder off, while a holder that was only slow
can still ack (or extend) until then. An expired delivery that its worker had
extended is *interrupted* (its worker was alive, then stopped); one never
extended is *charged* against max_deliveries; past either cap
(max_deliveries, max_interruptions) the message goes to the dead-letter set
with the reason instead of looping forever, and so does one whose state is
corrupt. A lease entry whose message is gone (no state) is a stray and is
removed. Every expiry is written to the queue's reclaim log (capped), so that
ops can tell later why a message was delivered again.

KEYS[1] leases    zset
KEYS[2] state     hash
KEYS[3] ready     zset
KEYS[4] seq       string  the sequence an earlier version kept (read once, when the counters start)
KEYS[5] wake      zset
KEYS[6] counters  string  (lua/include/counters.lua)
KEYS[7] dead      zset
KEYS[8] reasons   hash
KEYS[9] reclaims  list

ARGV[1] max deliveries   ARGV[2] max interruptions   ARGV[3] limit (messages per call)
ARGV[4] lease ms (the log's last extension: deadline - lease)
ARGV[5] queue ttl ms (0: the queue does not expire)

Reply: {reclaimed, dead_lettered, id, reason, id, reason, ...} (the ids dead-lettered now)
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]
--- @include "check_types"
--- @include "arg_int"
--- @include "server_time"
--- @include "wake"
--- @include "reclaim_expired"
--- @include "keep_expiry"
local leases, state, ready, seq, wake_key, counters, dead, reasons, reclaims =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9]
if #KEYS ~= 9 or #ARGV ~= 5 then error({err = 'FENCED BADARG reclaim needs 9 keys and 5 arguments'}) end
local limits = {arg_int(ARGV[1], 'max deliveries', 1, 1e9), arg_int(ARGV[2], 'max interruptions', 1, 1e9)}
local limit = arg_int(ARGV[3], 'limit', 1, 100000)
local lease = arg_int(ARGV[4], 'lease ms', 1, 1e12)
local ttl = arg_int(ARGV[5], 'queue ttl', 0, 1e12)

local now_ms, now_us = server_time()
-- The usual case (nothing expired): nothing written, nothing to check.
if #redis.call('ZRANGE', leases, '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, 1) == 0 then return {0, 0} end
check_types({{leases, 'zset'}, {state, 'hash'}, {ready, 'zset'}, {wake_key, 'zset'},
             {counters, 'string'}, {dead, 'zset'}, {reasons, 'hash'}, {reclaims, 'list'}})
local k = {leases = leases, state = state, ready = ready, counters = counters, seq = seq, dead = dead,
           reasons = reasons, reclaims = reclaims}
local result = reclaim_expired(k, now_ms, now_us, limit, lease, limits)
local dead_count = #result.dead / 2
if result.reclaimed > 0 then wake(wake_key) end
add_counts(counters, {reclaimed = result.reclaimed, dead_lettered = dead_count,
                      interrupted = result.interrupted, stray_leases_removed = result.strays})
keep_expiry(ttl, {state, ready, wake_key, counters, dead, reasons, reclaims})
local out = {result.reclaimed, dead_count}
for _, v in ipairs(result.dead) do out[#out + 1] = v end
return out
