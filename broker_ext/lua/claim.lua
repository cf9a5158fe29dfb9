#!lua flags=allow-oom
--[[
claim: take up to N ready messages and lease them, in one atomic step.

First, expired leases of the queue go back to ready (or to the dead-letter
set), and due delayed messages become ready, both by Redis server time: a
consumer of any kind (basic_get included) sees expired work come back. Then
each claimed message gets a fencing token strictly greater than any it had
before in this Redis's history, max(previous token + 1, server time in µs +
its place in this claim), and the claim's id: random per claim, so a delivery
is its (token, claim) pair, and two deliveries that got the same token (a
failover or restart that lost the last writes) are still told apart. The
lease deadline is server time plus the lease, never a worker's clock.

The claim id doubles as the request id: the same request sent again (a client
retry after a lost reply) returns the deliveries it leased that are still its
own, instead of leasing more (never a delivery someone else got since).

A ready message that cannot be delivered (its body or state is missing, or
its state is not a state record) is not dropped: it goes to the dead-letter
set with the reason, for an operator to look at.

With no_ack = 1 the messages are removed at once (consumers that never ack,
such as remote-control reply queues).

Idle consumers block on the queue's wake-up marker (BZPOPMIN), which a
publish sets and one consumer takes: so while ready messages remain after
this claim, the claim sets it again for the next consumer (ARGV[11]: not
when its consumer claims again at once anyway, the poll of a busy one).

Each step reads and checks first, then writes only what passed.

KEYS[1]  ready     zset
KEYS[2]  delayed   zset
KEYS[3]  leases    zset
KEYS[4]  bodies    hash
KEYS[5]  state     hash
KEYS[6]  seq       string  the sequence an earlier version kept (read once, when the counters start)
KEYS[7]  counters  string  the sequence and the counters (lua/include/counters.lua)
KEYS[8]  request   string  ids this claim leased, for a resent claim (expires)
KEYS[9]  dead      zset
KEYS[10] reasons   hash
KEYS[11] wake      zset
KEYS[12] reclaims  list

ARGV[1] count (>= 1)   ARGV[2] lease ms   ARGV[3] claim id (letters and digits)
ARGV[4] request ttl ms   ARGV[5] no_ack (0/1)   ARGV[6] most delayed messages to promote
ARGV[7] max deliveries   ARGV[8] max interruptions   ARGV[9] most expired leases to reclaim
ARGV[10] queue ttl ms (0: the queue does not expire; else every key's expiry is pushed)
ARGV[11] wake the next consumer when messages remain ready (0/1)

Reply: {deliveries, dead}: deliveries is a flat array, four entries per delivery (id, token,
deliveries, payload); dead is a flat array of (id, reason) set aside by this call.
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]
--- @include "check_types"
--- @include "arg_int"
--- @include "server_time"
--- @include "state"
--- @include "set_dead"
--- @include "ready"
--- @include "wake"
--- @include "reclaim_expired"
--- @include "keep_expiry"
local ready, delayed, leases, bodies, state, seq, counters, request, dead, reasons, wake_key, reclaims =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12]
if #KEYS ~= 12 or #ARGV ~= 11 then error({err = 'FENCED BADARG claim needs 12 keys and 11 arguments'}) end
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
if not string.match(claim_id, '^%w+$') then error({err = 'FENCED BADARG claim id must be letters and digits'}) end

local now_ms, now_us = server_time()
local out, dead_out = {}, {}

-- A resent request: hand back what the first one leased, where that lease is still its own.
local previous = redis.call('GET', request)
if previous then
  for id in string.gmatch(previous, '[^\n]+') do
    local s = parse_state(redis.call('HGET', state, id))
    local body = redis.call('HGET', bodies, id)
    if s and body and s.claim == claim_id and redis.call('ZSCORE', leases, id) then
      out[#out + 1] = id
      out[#out + 1] = string.format('%.0f', s.token)
      out[#out + 1] = s.deliveries
      out[#out + 1] = body
    end
  end
  return {out, dead_out}
end

local function touch_queue()
  keep_expiry(ttl, {ready, delayed, leases, bodies, state, counters, dead, reasons, wake_key, reclaims})
end

-- An idle queue (what every consumer polls for, once a second) costs these reads and nothing more.
local due = {}
if promote > 0 then due = redis.call('ZRANGE', delayed, '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, promote) end
local expiring = reclaim_limit > 0 and #redis.call('ZRANGE', leases, '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, 1) > 0
if #due == 0 and not expiring and redis.call('ZCARD', ready) == 0 then
  touch_queue()
  return {out, dead_out}
end
check_types({{ready, 'zset'}, {delayed, 'zset'}, {leases, 'zset'}, {bodies, 'hash'}, {state, 'hash'},
             {counters, 'string'}, {request, 'string'}, {dead, 'zset'}, {reasons, 'hash'},
             {wake_key, 'zset'}, {reclaims, 'list'}})

-- Expired leases back to ready (or dead), before anything is taken.
local reclaimed = {reclaimed = 0, strays = 0, interrupted = 0, dead = {}}
if expiring then
  local k = {leases = leases, state = state, ready = ready, counters = counters, seq = seq, dead = dead,
             reasons = reasons, reclaims = reclaims}
  reclaimed = reclaim_expired(k, now_ms, now_us, reclaim_limit, lease, limits)
  for _, v in ipairs(reclaimed.dead) do dead_out[#dead_out + 1] = v end
end

-- Due delayed messages, read and checked, then made ready (or set aside when corrupt).
local due_states = {}
for i, id in ipairs(due) do due_states[i] = parse_state(redis.call('HGET', state, id)) end
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

-- The ready messages this claim takes, read and checked, then leased (or set aside).
local peeked = redis.call('ZRANGE', ready, 0, count - 1)
local peeked_states, peeked_bodies = {}, {}
for i, id in ipairs(peeked) do
  peeked_states[i] = parse_state(redis.call('HGET', state, id))
  peeked_bodies[i] = redis.call('HGET', bodies, id)
end
local leased = {}
for i, id in ipairs(peeked) do
  redis.call('ZREM', ready, id)
  local s, body = peeked_states[i], peeked_bodies[i]
  local reason = nil
  if not s then
    reason = 'undeliverable: missing or corrupt state'
    redis.call('HSET', state, id, string.format('%.0f', now_us) .. '|0|0|0|0|' .. now_ms .. '|0|')
    s = {deliveries = 0}
  elseif not body then
    reason = 'undeliverable: body missing'
  else
    -- "+ i - 1": messages claimed together get distinct tokens (two of them may share a key).
    s.token = math.max(s.token + 1, now_us + i - 1)
    s.deliveries = s.deliveries + 1
    s.claim = claim_id
    s.first_deadline = now_ms + lease
    if no_ack then
      redis.call('HDEL', bodies, id)
      redis.call('HDEL', state, id)
    else
      redis.call('HSET', state, id, format_state(s))
      redis.call('ZADD', leases, s.first_deadline, id)
      leased[#leased + 1] = id
    end
    out[#out + 1] = id
    out[#out + 1] = string.format('%.0f', s.token)
    out[#out + 1] = s.deliveries
    out[#out + 1] = body
  end
  if reason then
    set_dead(dead, reasons, id, now_ms, reason, s.deliveries)
    dead_out[#dead_out + 1] = id
    dead_out[#dead_out + 1] = reason
  end
end
if wake_next and (#peeked > 0 or reclaimed.reclaimed > 0) and redis.call('ZCARD', ready) > 0 then
  wake(wake_key)
end
if #leased > 0 and request_ttl > 0 then
  local keep = ttl > 0 and math.min(request_ttl, ttl) or request_ttl
  redis.call('SET', request, table.concat(leased, '\n'), 'PX', keep)
end
add_counts(counters, {claimed = #out / 4, dead_lettered = #dead_out / 2, reclaimed = reclaimed.reclaimed,
                      interrupted = reclaimed.interrupted, stray_leases_removed = reclaimed.strays})
touch_queue()
return {out, dead_out}
