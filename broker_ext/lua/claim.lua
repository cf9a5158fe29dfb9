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

Cost: a consumer at prefetch 1, one ack and one message per call, takes a straight path with no table
or helper built for it, and runs 13 commands in here (TIME; ZPOPMIN; HMGET of the acked and the claimed
state; HGET of the body; SET of the request; one BITFIELD for the counters; ZADD done and HSETNX acks;
ZREM and ZADD leases; HSET and HDEL state; HDEL bodies), two ZRANGE more on an upkeep claim, and a few
more every 32 acks (the done window's pruning). Any other case (several messages or acks, upkeep with
work to do, the ack not current or its message popped, a message to set aside, a resent request, a
queue with x-expires) is found before the straight path writes anything that is not undone, and takes
the general path. No key's type is checked up front (a TYPE per key per call: they were 19 of the 45
commands a message cost). Every key is first met by a read the claim needs anyway, or by a write that
fails before it writes when its key is of the wrong type and that is undone exactly (the general path:
guarded(), lua/include/guard.lua): ZPOPMIN (popped entries go back with their scores), SET NX of the
request, the counters' BITFIELD, the done records (read first when one was there). `leases` comes
last: once it has been written nothing can be refused. So a key of the wrong type is refused with
FENCED WRONGTYPE and nothing written. Where the work is not the common one (expired leases or due
delayed messages to move, several acks, a message to set aside), the keys it touches are checked with
TYPE first, as before.

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
--- @include "arg_int"
--- @include "wake"
--- @include "hash_table"
local ready, delayed, leases, bodies, state, seq, counters, request, dead, reasons, wake_key, reclaims, done, acks =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12],
  KEYS[13], KEYS[14]
if #KEYS ~= 14 or #ARGV < 12 or (#ARGV - 12) % 3 ~= 0 then
  error({err = 'FENCED BADARG claim needs 14 keys, 12 arguments and id/token/claim triples to ack'})
end

-- The straight path: a consumer at prefetch 1 (one message, at most one ack, no upkeep work to do,
-- no_ack 0, a queue without x-expires), with no table or helper built for it (each costs every call
-- that runs past it). Its writes run in a fixed order, so one number says how far the first ones got
-- (sw: 1 popped, 2 request set, 3 counted), and the replies of the done and acks records and of the
-- wake-up marker what those wrote (nil: not sent). A command that fails leaves `refusal` and breaks
-- out; so does a case it does not take (the ack not current, the acked id popped, a message that
-- cannot be delivered, a resent request), each found while only ready has been written. Below the
-- helpers, its writes are undone, newest first; then it refuses, or the general path runs as if the
-- straight one had not.
local sw, refusal, straight = 0, nil, ARGV[1] == '1' and ARGV[5] == '0' and ARGV[10] == '0'
  and (#ARGV == 12 or #ARGV == 15)
local s_id, s_score, s_acking, s_done_old, s_done_added, s_acks_old, s_acks_set, s_wake_added
repeat
  if not straight then break end
  local lease_ms = arg_int(ARGV[2], 'lease ms', 1, 1e12)
  local request_ttl = arg_int(ARGV[4], 'request ttl ms', 0, 1e12)
  local promote = ARGV[6] == '0' and 0 or arg_int(ARGV[6], 'promote limit', 0, 100000)
  arg_int(ARGV[7], 'max deliveries', 1, 1e9)
  arg_int(ARGV[8], 'max interruptions', 1, 1e9)
  local reclaim_limit = ARGV[9] == '0' and 0 or arg_int(ARGV[9], 'reclaim limit', 0, 100000)
  local wake_next = arg_int(ARGV[11], 'wake next', 0, 1) == 1
  local window = arg_int(ARGV[12], 'done window', 0, 1e12)
  local claim_id = ARGV[3]
  if not string.find(claim_id, '^%w+$') then error({err = 'FENCED BADARG claim id must be letters and digits'}) end
  local ack_id, ack_token, ack_claim = ARGV[13], ARGV[14], ARGV[15]
  s_acking = ack_id ~= nil
  -- Server time as text too: seconds and micros from TIME, joined (a number made text costs a sprintf).
  local t = redis.call('TIME')
  local us6 = string.sub('00000' .. t[2], -6)
  local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local now_ms = t[1] .. string.sub(us6, 1, 3)
  local reply
  -- Upkeep, when asked: with no due delayed message and no expired lease, it has nothing to do.
  if promote > 0 then
    reply = redis.pcall('ZRANGE', delayed, '-inf', now_ms, 'BYSCORE', 'LIMIT', '0', '1')
    if reply.err then refusal = {reply, delayed} break end
    if #reply > 0 then break end
  end
  if reclaim_limit > 0 then
    reply = redis.pcall('ZRANGE', leases, '-inf', now_ms, 'BYSCORE', 'LIMIT', '0', '1')
    if reply.err then refusal = {reply, leases} break end
    if #reply > 0 then break end
  end
  reply = redis.pcall('ZPOPMIN', ready, 1)
  if reply.err then refusal = {reply, ready} break end
  if #reply == 0 then break end
  s_id, s_score, sw = reply[1], reply[2], 1
  if s_id == ack_id then break end
  local raw, ack_raw, body
  if s_acking then
    reply = redis.pcall('HMGET', state, ack_id, s_id)
    if reply.err then refusal = {reply, state} break end
    ack_raw, raw = reply[1], reply[2]
  else
    raw = redis.pcall('HGET', state, s_id)
    if type(raw) == 'table' then refusal = {raw, state} break end
  end
  body = redis.pcall('HGET', bodies, s_id)
  if type(body) == 'table' then refusal = {body, bodies} break end
  local record
  if s_acking then
    local tk, cl, pb = string.match(ack_raw or '', '^(%d+)|%d+|%d+|%d+|%d|%d+|%d+|(%w*)|([%w_.:@/+=,~%-]*)$')
    if tk ~= ack_token or cl ~= ack_claim then break end
    record = tk .. '|' .. cl .. '|' .. pb
  end
  if not body then break end
  local tk, dl, middle, pb = string.match(raw or '', '^(%d+)|(%d+)|(%d+|%d+|%d|%d+)|%d+|%w*|([%w_.:@/+=,~%-]*)$')
  if not tk then break end
  if request_ttl > 0 then
    reply = redis.pcall('SET', request, s_id, 'NX', 'GET', 'PX', ARGV[4])
    if type(reply) == 'table' then refusal = {reply, request} break end
    if reply then break end
    sw = 2
  end
  if s_acking then
    reply = redis.pcall('BITFIELD', counters, 'INCRBY', 'i64', '#2', '1', 'INCRBY', 'i64', '#3', '1')
  else
    reply = redis.pcall('BITFIELD', counters, 'INCRBY', 'i64', '#2', '1')
  end
  if reply.err then refusal = {reply, counters} break end
  sw = 3
  local acked_total = reply[2]
  if s_acking and window > 0 then
    reply = redis.pcall('ZADD', done, 'NX', now_ms, ack_id)
    if type(reply) == 'table' then refusal = {reply, done} break end
    s_done_added = reply
    if reply == 0 then
      s_done_old = redis.call('ZSCORE', done, ack_id)
      redis.call('ZADD', done, now_ms, ack_id)
    end
    reply = redis.pcall('HSETNX', acks, ack_id, record)
    if type(reply) == 'table' then refusal = {reply, acks} break end
    s_acks_set = reply
    if reply == 0 then
      s_acks_old = redis.call('HGET', acks, ack_id)
      redis.call('HSET', acks, ack_id, record)
    end
  end
  if wake_next and redis.call('ZCARD', ready) > 0 then
    reply = redis.pcall('ZADD', wake_key, 0, WAKE_MEMBER)
    if type(reply) == 'table' then refusal = {reply, wake_key} break end
    s_wake_added = reply
  end
  -- The acked delivery out of `leases`: not leased (reclaimed, its holder was slow), it is looked for
  -- in ready and delayed.
  local in_ready, in_delayed = false, false
  if s_acking then
    reply = redis.pcall('ZREM', leases, ack_id)
    if type(reply) == 'table' then refusal = {reply, leases} break end
    if reply == 0 then
      in_ready = redis.call('ZSCORE', ready, ack_id)
      in_delayed = redis.pcall('ZSCORE', delayed, ack_id)
      if type(in_delayed) == 'table' then refusal = {in_delayed, delayed} break end
    end
  end
  -- Leases: the last key whose type was not known. Nothing below can be refused. The token is
  -- max(previous + 1, server time in us), as text without a sprintf when it is server time.
  local deadline = string.format('%.0f', tonumber(now_ms) + lease_ms)
  reply = redis.pcall('ZADD', leases, deadline, s_id)
  if type(reply) == 'table' then refusal = {reply, leases} break end
  local previous = tonumber(tk)
  local token = previous < now_us and t[1] .. us6 or string.format('%.0f', previous + 1)
  local deliveries = dl == '0' and 1 or tonumber(dl) + 1
  redis.call('HSET', state, s_id, token .. '|' .. (dl == '0' and '1' or deliveries) .. '|' .. middle .. '|'
    .. deadline .. '|' .. claim_id .. '|' .. pb)
  if not s_acking then return {{s_id, token, deliveries, body}, {}, {}} end
  if in_ready then redis.call('ZREM', ready, ack_id) end
  if in_delayed then redis.call('ZREM', delayed, ack_id) end
  redis.call('HDEL', state, ack_id)
  redis.call('HDEL', bodies, ack_id)
  -- The done window's pruning, every 32 acks of the queue (finish.lua's PRUNE_EVERY), which keeps
  -- `acks` a hash table too.
  if window > 0 and acked_total % 32 == 0 then
    redis.call('HSETNX', acks, TABLE_FIELD, TABLE_VALUE)
    local old = redis.call('ZRANGE', done, '-inf', tonumber(now_ms) - window, 'BYSCORE', 'LIMIT', 0, 130)
    if #old > 0 then
      redis.call('ZREM', done, unpack(old))
      redis.call('HDEL', acks, unpack(old))
    end
  end
  return {{s_id, token, deliveries, body}, {}, {1}}
until true

--- @include "guard"
--- @include "check_types"
--- @include "server_time"
--- @include "state"
--- @include "set_dead"
--- @include "ready"
--- @include "reclaim_expired"
--- @include "finish"
--- @include "chunked"
--- @include "keep_expiry"
-- What the straight path wrote, undone newest first; then its refusal, or the general path.
if sw > 0 then
  if s_wake_added == 1 then redis.call('ZREM', wake_key, WAKE_MEMBER) end
  if s_acks_set == 1 then redis.call('HDEL', acks, ARGV[13]) end
  if s_acks_set == 0 then redis.call('HSET', acks, ARGV[13], s_acks_old) end
  if s_done_added == 1 then redis.call('ZREM', done, ARGV[13]) end
  if s_done_added == 0 then redis.call('ZADD', done, s_done_old, ARGV[13]) end
  if sw >= 3 then uncount(counters, {claimed = 1, acked = s_acking and 1 or nil}) end
  if sw >= 2 then redis.call('DEL', request) end
  redis.call('ZADD', ready, s_score, s_id)
end
if refusal then
  local kind = string.find(refusal[1].err, 'WRONGTYPE', 1, true) and 'WRONGTYPE' or 'REFUSED'
  error({err = 'FENCED ' .. kind .. ' ' .. refusal[2] .. ': ' .. refusal[1].err})
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
