#!lua
--[[
publish: store one or more messages and make each ready (or delayed), atomically.

Idempotent on the publish id, which names one publish call: a resend of the
same call (redis-py after a lost reply, Kombu's ensure() retrying) meets the
record of its message id, stored or acked within the done window, with its
publish id there, and is reported DUPLICATE without writing. A publish of a
known message id with another publish id is a new publish and is stored, as
the stock transport stores it: under its own id once the first is acked, or,
while a message of that id is still live, beside it under "<id>~<n>" (n from
the queue's sequence), which the live message's record lists so that a resend
of that publish finds it too. A message with a dedup key whose window is
still open is reported DEDUPLICATED (the first message keeps the key).

A single message costs 7 commands in here: the done window read, TIME,
HSETNX of its state (which also tells a live id apart), one BITFIELD for the
sequence and the counters, the body, the ready entry and the wake-up marker.
No key's type is checked up front: the first write (HSETNX state) fails
before anything is written, and every later one goes through guarded(),
which undoes the writes before it when it fails (lua/include/guard.lua), so
a key of the wrong type is refused with FENCED WRONGTYPE and nothing
written. No flags: at maxmemory Redis refuses it before it starts.

KEYS[1]  bodies   hash   id -> payload
KEYS[2]  state    hash   id -> state record (see lua/include/state.lua)
KEYS[3]  ready    zset   id -> priority * 1e14 + seq
KEYS[4]  delayed  zset   id -> due ms (server time)
KEYS[5]  seq      string the sequence an earlier version kept (read once, when the counters start)
KEYS[6]  done     zset   recently acked ids
KEYS[7]  wake     zset   the wake-up marker of blocked consumers (lua/include/wake.lua)
KEYS[8]  counters string the sequence and the counters (lua/include/counters.lua)
KEYS[9]  dedups   list   recent deduplicated publishes (capped)
KEYS[10] acks     hash   acked id -> "token|claim|publish ids" (lua/include/publish_ids.lua)
KEYS[10+i] dedup  string dedup key of message i (a placeholder key when it has none)

ARGV[1]  queue ttl ms (0: the queue does not expire): every key of the queue expires then,
         unless a consumer keeps it alive
ARGV[2+6*(i-1) ...] per message i: id, payload, priority 0-9, delay ms,
         dedup window ms (0: no dedup key), publish id (letters, digits and _.:@/+=-)

Reply: one integer per message:
   1 STORED        stored and ready (or delayed)
   3 DUPLICATE     this publish id is already known for this message id: nothing written
   4 DEDUPLICATED  dedup key still held by another message: nothing written
Errors (nothing written): "FENCED WRONGTYPE <key>: ...", "FENCED BADARG <what>".
--]]
--- @include "arg_int"
--- @include "guard"
--- @include "server_time"
--- @include "state"
--- @include "publish_ids"
--- @include "ready"
--- @include "wake"
--- @include "keep_expiry"
local bodies, state, ready, delayed, seq, done, wake_key, counters, dedups, acks =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local count = (#ARGV - 1) / 6
if count < 1 or count ~= math.floor(count) or #KEYS ~= 10 + count then
  error({err = 'FENCED BADARG publish needs 10 + n keys and 1 + 6n arguments'})
end
local ttl = arg_int(ARGV[1], 'queue ttl', 0, 1e12)
local messages, ids = {}, {}
for i = 1, count do
  local base = 2 + 6 * (i - 1)
  local id, publish_id = ARGV[base], ARGV[base + 5]
  if id == '' or string.find(id, '\n', 1, true) then
    error({err = 'FENCED BADARG message ' .. i .. ': the id must be non-empty and hold no newline'})
  end
  if #publish_id > 128 or not string.match(publish_id, '^[%w_.:@/+=%-]+$') then
    error({err = 'FENCED BADARG message ' .. i .. ': the publish id must be 1-128 letters, digits or _.:@/+=-'})
  end
  messages[i] = {
    id = id, payload = ARGV[base + 1], publish_id = publish_id,
    priority = arg_int(ARGV[base + 2], 'priority of message ' .. i, 0, 9),
    delay = arg_int(ARGV[base + 3], 'delay ms of message ' .. i, 0, 1e12),
    window = arg_int(ARGV[base + 4], 'dedup window ms of message ' .. i, 0, 1e12),
    dedup = KEYS[10 + i], earlier = '',
  }
  ids[i] = id
end

-- Reads. An id acked within the window keeps its publish ids in `acks`: a resend is found there,
-- and a new message of that id starts its own list with them.
local acked = guarded(nil, 'ZMSCORE', done, unpack(ids))
for i, m in ipairs(messages) do
  if acked[i] then
    m.earlier = string.match(guarded(nil, 'HGET', acks, m.id) or '', '^[^|]*|[^|]*|(.*)$') or ''
    m.known = publish_id_known(m.earlier, m.publish_id)
  end
end
local now_ms = server_time()

-- Each message's record: HSETNX claims the id, or says it is live (then a resend, or one beside it).
local function record_of(m)
  return '0|0|0|0|' .. m.priority .. '|' .. now_ms .. '|0||' .. publish_ids_with(m.earlier, m.publish_id)
end
local function forget_state(id)
  return function(written) if written == 1 then redis.call('HDEL', state, id) end end
end
local stored, duplicates, deduplicated = {}, 0, 0
local replies = {}
for i, m in ipairs(messages) do
  -- A message with a dedup key reads first: a held key must leave nothing written.
  local live = nil
  if not m.known then
    live = m.window > 0 and guarded(nil, 'HGET', state, m.id)
    if not live and not (m.window > 0 and guarded(nil, 'GET', m.dedup)) then
      if guarded(forget_state(m.id), 'HSETNX', state, m.id, record_of(m)) == 0 then
        live = guarded(nil, 'HGET', state, m.id)
      else
        m.new = true
      end
    end
  end
  if live then
    local s = parse_state(live)
    if s then m.known = publish_id_known(s.publish_ids, m.publish_id) end
    m.beside = not m.known
  end
  if m.known then
    replies[i] = 3
    duplicates = duplicates + 1
  elseif m.new or m.beside then
    replies[i] = 1
    stored[#stored + 1] = m
  else
    replies[i] = 4
    deduplicated = deduplicated + 1
    m.deduplicated = true
  end
end

-- The sequence numbers and the counts in one BITFIELD; a message stored beside a live one is named
-- after its number.
local counts = {seq = #stored, published = #stored, duplicate_publishes = duplicates,
                deduplicated_publishes = deduplicated}
local counted = {}
local args, names = counter_args('INCRBY', counts)
if #names > 0 then
  local values = guarded(function() uncount(counters, counts) end, 'BITFIELD', counters, unpack(args))
  for i, name in ipairs(names) do counted[name] = values[i] end
end
local first = #stored > 0 and seq_after(counted.seq, #stored, counters, seq) or 0
local fields, ready_entries, delayed_entries, made_ready = {}, {}, {}, {}
for i, m in ipairs(stored) do
  local n = first + i - 1
  m.stored_id = m.id
  if m.beside then
    -- Named after its number, listed in the live record (read again: one of this call may have).
    local suffix = '~' .. string.format('%.0f', n)
    m.stored_id = m.id .. suffix
    local raw = redis.call('HGET', state, m.id)
    local s = parse_state(raw)
    if s then
      s.publish_ids = publish_ids_with(s.publish_ids, m.publish_id .. suffix)
      guarded(function() redis.call('HSET', state, m.id, raw) end, 'HSET', state, m.id, format_state(s))
    end
    guarded(forget_state(m.stored_id), 'HSET', state, m.stored_id, record_of(m))
  end
  fields[#fields + 1] = m.stored_id
  fields[#fields + 1] = m.payload
  if m.delay > 0 then
    delayed_entries[#delayed_entries + 1] = now_ms + m.delay
    delayed_entries[#delayed_entries + 1] = m.stored_id
  else
    ready_entries[#ready_entries + 1] = ready_score(m.priority, n, false)
    ready_entries[#ready_entries + 1] = m.stored_id
    made_ready[#made_ready + 1] = m.stored_id
  end
end

-- The writes, each undone if a later one fails.
local function remover(command, key, members)
  return function() if #members > 0 then redis.call(command, key, unpack(members)) end end
end
local stored_ids = {}
for i, m in ipairs(stored) do stored_ids[i] = m.stored_id end
if #fields > 0 then guarded(remover('HDEL', bodies, stored_ids), 'HSET', bodies, unpack(fields)) end
if #ready_entries > 0 then guarded(remover('ZREM', ready, made_ready), 'ZADD', ready, unpack(ready_entries)) end
if #delayed_entries > 0 then
  guarded(remover('ZREM', delayed, stored_ids), 'ZADD', delayed, unpack(delayed_entries))
end
for _, m in ipairs(stored) do
  if m.window > 0 then
    local keep = ttl > 0 and math.min(m.window, ttl) or m.window
    guarded(function() redis.call('DEL', m.dedup) end, 'SET', m.dedup, m.stored_id, 'PX', keep)
  end
end
local logged = false
for _, m in ipairs(messages) do
  if m.deduplicated then
    local entry = cjson.encode({key = m.dedup, id = m.id, kept = redis.call('GET', m.dedup), at_ms = now_ms})
    guarded(function() redis.call('LPOP', dedups) end, 'LPUSH', dedups, entry)
    logged = true
  end
end
if #made_ready > 0 then
  guarded(function(added) if added == 1 then redis.call('ZREM', wake_key, WAKE_MEMBER) end end,
    'ZADD', wake_key, 0, WAKE_MEMBER)
end
if logged then redis.call('LTRIM', dedups, 0, 999) end
keep_expiry(ttl, {bodies, state, ready, delayed, done, wake_key, counters, dedups, acks})
return replies
