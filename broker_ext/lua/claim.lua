#!lua flags=allow-oom
--[[
claim: finish the deliveries the consumer acks, then take up to N ready messages and lease them, in
one atomic step.

The acks come first, as ack.lua would do them (lua/include/finish.lua; same replies): a consumer's
buffered acks of this queue travel in its next claim, so a consumer at prefetch 1 pays one script
call, in one round trip, per message. A message acked here is never claimed again by this call, even
when its lease had expired and it was back in ready.

Then expired leases of the queue go back to ready (or to the dead-letter set), and due delayed
messages become ready, both by Redis server time, when the caller asks (ARGV[6], ARGV[9]: every claim
of an idle consumer and of basic_get, a busy consumer's at most every `upkeep_interval`; lease keepers
reclaim on their own): a consumer of any kind sees expired work come back. Then each claimed message
gets a fencing token strictly greater than any it had before in this Redis's history, max(previous
token + 1, server time in µs + its place in this claim), and the claim's id: random per claim, so a
delivery is its (token, claim) pair, and two deliveries that got the same token (a failover or restart
that lost the last writes) are still told apart. The lease deadline is server time plus the lease,
never a worker's clock.

The claim id doubles as the request id: the same request sent again (a client retry after a lost
reply) returns the deliveries it leased that are still its own, instead of leasing more (never a
delivery someone else got since).

A ready message that cannot be delivered (its body or state is missing, or its state is not a state
record) is not dropped: it goes to the dead-letter set with the reason, for an operator to look at.

With no_ack = 1 the messages are removed at once (consumers that never ack, such as remote-control
reply queues).

Idle consumers block on the queue's wake-up marker (BZPOPMIN), which a publish sets and one consumer
takes: so while ready messages remain after this claim, the claim sets it again for the next consumer
(ARGV[11]: not when its consumer claims again at once anyway, the poll of a busy one).

Cost: a busy consumer at prefetch 1, one ack and one message per call, runs 14 commands in here (TIME;
HMGET of the acked state; ZPOPMIN; SET of the request; HMGET of the claimed state and body; one
BITFIELD for the counters; ZADD done and HSETNX acks; ZREM and ZADD leases; HSET and HDEL state; HDEL
bodies), and a few more every 32 acks (the done window's pruning). No key's type is checked up front
(a TYPE per key per call: they were 19 of the 45 commands a message cost). Every key is first met
by a read the claim needs anyway, or by a write that fails before it writes when its key is of the
wrong type and that guarded() can undo exactly (lua/include/guard.lua): ZPOPMIN (popped entries
go back with their scores), SET NX of the request, the counters' BITFIELD, the done records (read
first when one was there). `leases` comes last: once it has been written nothing can be refused. So a
key of the wrong type is refused with FENCED WRONGTYPE and nothing written. Where the work is not
the common one (expired leases or due delayed messages to move, several acks, a message to set
aside), the keys it touches are checked with TYPE first, as before.

KEYS[1]  ready     zset
KEYS[2]  delayed   zset
KEYS[3]  leases    zset
KEYS[4]  bodies    hash
KEYS[5]  state     hash
KEYS[6]  seq       string  the sequence an earlier version kept (read once, when the counters start)
KEYS[7]  counters  string  the sequence and the counters (lua/include/counters.lua)
KEYS[8]  request   string  ids this claim took, for a resent claim (expires)
KEYS[9]  dead      zset
KEYS[10] reasons   hash
KEYS[11] wake      zset
KEYS[12] reclaims  list
KEYS[13] done      zset    acked id -> acked at ms
KEYS[14] acks      hash    acked id -> "token|claim|publish ids" (see ack.lua)

ARGV[1] count (>= 1)   ARGV[2] lease ms   ARGV[3] claim id (letters and digits)
ARGV[4] request ttl ms   ARGV[5] no_ack (0/1)   ARGV[6] most delayed messages to promote (0: none)
ARGV[7] max deliveries   ARGV[8] max interruptions   ARGV[9] most expired leases to reclaim (0: none)
ARGV[10] queue ttl ms (0: the queue does not expire; else every key's expiry is pushed)
ARGV[11] wake the next consumer when messages remain ready (0/1)
ARGV[12] done window ms (0: keep no record of acked ids)
ARGV[13..] triples to ack first: id, token, claim (none: a plain claim)

Reply: {deliveries, dead, acks}: deliveries is a flat array, four entries per delivery (id, token,
deliveries, payload); dead is a flat array of (id, reason) set aside by this call; acks has one
integer per triple, as ack.lua replies (1 OK, 2 ALREADY_ACKED, -1 NOT_FOUND, -2 STALE).
Errors (nothing written): "FENCED WRONGTYPE <key>: ...", "FENCED BADARG <what>", "FENCED CORRUPT <id>".
--]]
--- @include "guard"
--- @include "check_types"
--- @include "arg_int"
--- @include "server_time"
--- @include "state"
--- @include "set_dead"
--- @include "ready"
--- @include "wake"
--- @include "reclaim_expired"
--- @include "finish"
--- @include "chunked"
--- @include "keep_expiry"
local ready, delayed, leases, bodies, state, seq, counters, request, dead, reasons, wake_key, reclaims, done, acks =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12],
  KEYS[13], KEYS[14]
if #KEYS ~= 14 or #ARGV < 12 or (#ARGV - 12) % 3 ~= 0 then
  error({err = 'FENCED BADARG claim needs 14 keys, 12 arguments and id/token/claim triples to ack'})
end
local count = arg_int(ARGV[1], 'count', 1, 100000)
local lease = arg_int(ARGV[2], 'lease ms', 1, 1e12)
local claim_id = ARGV[3]
local request_ttl = arg_int(ARGV[4], 'request ttl ms', 0, 1e12)
local no_ack = arg_int(ARGV[5], 'no_ack', 0, 1) == 1
local promote = arg_int(ARGV[6], 'promote limit', 0, 100000)
local limits = {arg_int(ARGV[7], 'max deliveries', 1, 1e9), arg_int(ARGV[8], 'max interruptions', 1, 1e9)}
local reclaim_limit = arg_int(ARGV[9], 'reclaim limit', 0, 100000)
local ttl = arg_int(ARGV[10], 'queue ttl', 0, 1e12)
local wake_next = arg_int(ARGV[11], 'wake next', 0, 1) == 1
local fk = {leases = leases, state = state, bodies = bodies, done = done, acks = acks, ready = ready,
            delayed = delayed, window = arg_int(ARGV[12], 'done window', 0, 1e12)}
if not string.match(claim_id, '^%w+$') then error({err = 'FENCED BADARG claim id must be letters and digits'}) end
local now_ms, now_us = server_time()
local out, dead_out = {}, {}
local counts = {claimed = 0, dead_lettered = 0, acked = 0, reclaimed = 0, interrupted = 0, stray_leases_removed = 0}

-- The acks: read and decided, nothing written yet.
local plan = finish_read(fk, ARGV, 13)
local acking = {}
for _, c in ipairs(plan.current) do acking[c.id] = true end
counts.acked = #plan.current

-- Upkeep, when asked: expired leases back to ready (or dead), due delayed messages made ready. Read
-- first; when there is work, every key is checked (TYPE) before the first write.
local due = {}
if promote > 0 then due = guarded(nil, 'ZRANGE', delayed, '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, promote) end
local expiring = reclaim_limit > 0 and #guarded(nil, 'ZRANGE', leases, '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, 1) > 0
local reclaimed = {reclaimed = 0, strays = 0, interrupted = 0, dead = {}}
if #due > 0 or expiring then
  check_types({{ready, 'zset'}, {delayed, 'zset'}, {leases, 'zset'}, {bodies, 'hash'}, {state, 'hash'},
               {counters, 'string'}, {request, 'string'}, {dead, 'zset'}, {reasons, 'hash'},
               {wake_key, 'zset'}, {reclaims, 'list'}, {done, 'zset'}, {acks, 'hash'}})
  local due_states = {}
  for i, id in ipairs(due) do due_states[i] = parse_state(redis.call('HGET', state, id)) end
  if expiring then
    local k = {leases = leases, state = state, ready = ready, counters = counters, seq = seq, dead = dead,
               reasons = reasons, reclaims = reclaims}
    reclaimed = reclaim_expired(k, now_ms, now_us, reclaim_limit, lease, limits)
    for _, v in ipairs(reclaimed.dead) do dead_out[#dead_out + 1] = v end
  end
  for i, id in ipairs(due) do
    redis.call('ZREM', delayed, id)
    if due_states[i] then
      make_ready(ready, counters, seq, id, due_states[i].priority, false)
    else
      local reason = 'undeliverable: missing or corrupt state'
      redis.call('HSET', state, id, string.format('%.0f', now_us) .. '|0|0|0|0|' .. now_ms .. '|0|')
      set_dead(dead, reasons, id, now_ms, reason, 0)
      dead_out[#dead_out + 1] = id
      dead_out[#dead_out + 1] = reason
    end
  end
  counts.reclaimed, counts.interrupted = reclaimed.reclaimed, reclaimed.interrupted
  counts.stray_leases_removed = reclaimed.strays
end

-- Take the ready messages (never one acked above), each popped entry put back should a later write be refused.
local popped = {}
local wanted = count
local ready_pttl = ttl > 0 and redis.call('PTTL', ready) or 0
local function put_back(entries)
  for i = 1, #entries, 2 do redis.call('ZADD', ready, entries[i + 1], entries[i]) end
  if ready_pttl > 0 then redis.call('PEXPIRE', ready, ready_pttl) end
end
while wanted > 0 do
  local entries = guarded(put_back, 'ZPOPMIN', ready, wanted)
  wanted = 0
  for i = 1, #entries, 2 do
    if acking[entries[i]] then wanted = wanted + 1 else popped[#popped + 1] = entries[i] end
  end
end

-- A resent request: hand back what the first one leased, where that lease is still its own.
local previous = false
if #popped > 0 and request_ttl > 0 and not no_ack then
  local keep = ttl > 0 and math.min(request_ttl, ttl) or request_ttl
  previous = guarded(function(old) if not old then redis.call('DEL', request) end end,
    'SET', request, table.concat(popped, '\n'), 'NX', 'GET', 'PX', keep)
end
if previous then
  undo_writes()
  for id in string.gmatch(previous, '[^\n]+') do
    local s = parse_state(guarded(nil, 'HGET', state, id))
    local body = guarded(nil, 'HGET', bodies, id)
    if s and body and s.claim == claim_id and guarded(nil, 'ZSCORE', leases, id) then
      out[#out + 1] = id
      out[#out + 1] = string.format('%.0f', s.token)
      out[#out + 1] = s.deliveries
      out[#out + 1] = body
    end
  end
  popped = {}
end

-- The popped messages, read and checked (the keys of setting one aside too, when one must be).
local takes, undeliverable = {}, false
if #popped > 0 then
  local raws, payloads = chunked(refusing, 'HMGET', state, popped), chunked(refusing, 'HMGET', bodies, popped)
  for i, id in ipairs(popped) do
    takes[i] = {id = id, s = parse_state(raws[i]), body = payloads[i]}
    if not takes[i].s or not takes[i].body then undeliverable = true end
  end
end
if undeliverable then check_types_guarded({{dead, 'zset'}, {reasons, 'hash'}}) end
if #popped == 0 and #plan.current > 0 then guarded(nil, 'HLEN', bodies) end
for _, t in ipairs(takes) do
  if t.s and t.body then counts.claimed = counts.claimed + 1 else counts.dead_lettered = counts.dead_lettered + 1 end
end
counts.dead_lettered = counts.dead_lettered + #dead_out / 2

-- The writes whose keys may still be of the wrong type, each undone exactly if a later one is refused.
local totals = add_counts_guarded(counters, counts)
finish_records(fk, plan, now_ms)
if wake_next and (#popped > 0 or reclaimed.reclaimed > 0) and redis.call('ZCARD', ready) > 0 then
  guarded(function(added) if added == 1 then redis.call('ZREM', wake_key, WAKE_MEMBER) end end,
    'ZADD', wake_key, 0, WAKE_MEMBER)
end
finish_unlease(fk, plan)

-- Leases: the last key whose type was not known. Nothing below can be refused.
local states, leased, aside = {}, {}, {}
for i, t in ipairs(takes) do
  local s, id = t.s, t.id
  if not s or not t.body then
    aside[#aside + 1] = t
  else
    -- "+ i - 1": messages claimed together get distinct tokens (two of them may share a key).
    s.token = math.max(s.token + 1, now_us + i - 1)
    s.deliveries = s.deliveries + 1
    s.claim = claim_id
    s.first_deadline = now_ms + lease
    if no_ack then
      leased[#leased + 1] = id
    else
      states[#states + 1] = id
      states[#states + 1] = format_state(s)
      leased[#leased + 1] = s.first_deadline
      leased[#leased + 1] = id
    end
    out[#out + 1] = id
    out[#out + 1] = string.format('%.0f', s.token)
    out[#out + 1] = s.deliveries
    out[#out + 1] = t.body
  end
end
if no_ack then
  chunked(redis.call, 'HDEL', bodies, leased)
  chunked(redis.call, 'HDEL', state, leased)
else
  chunked(refusing, 'ZADD', leases, leased)
  chunked(redis.call, 'HSET', state, states)
end
for _, t in ipairs(aside) do
  local reason, deliveries = 'undeliverable: body missing', t.s and t.s.deliveries or 0
  if not t.s then
    reason = 'undeliverable: missing or corrupt state'
    redis.call('HSET', state, t.id, string.format('%.0f', now_us) .. '|0|0|0|0|' .. now_ms .. '|0|')
  end
  set_dead(dead, reasons, t.id, now_ms, reason, deliveries)
  dead_out[#dead_out + 1] = t.id
  dead_out[#dead_out + 1] = reason
end
finish_write(fk, plan)
finish_prune(fk, now_ms, totals.acked or 0, counts.acked)
keep_expiry(ttl, {ready, delayed, leases, bodies, state, counters, dead, reasons, wake_key, reclaims, done, acks})
return {out, dead_out, plan.replies}
