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

A single message costs 7 commands in here: the done window read (ZSCORE), TIME,
HSETNX of its state (which also tells a live id apart), one BITFIELD for the
sequence and the counters, the body, the ready entry and the wake-up marker.
A single new message without a dedup key (what .delay() sends) takes a
straight path with nothing else in it; any other case, found before anything
is written, takes the general one, which a batch takes too.
No key's type is checked up front: the first write (HSETNX state) fails
before anything is written, and every later one goes through call(), which,
when its command fails, undoes the writes before it (undo(), by what this
call has written so far), so a key of the wrong type is refused with FENCED
WRONGTYPE and nothing written. No flags: at maxmemory Redis refuses it
before it starts.

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
--- @include "server_time"
--- @include "ready"
--- @include "wake"
--- @include "keep_expiry"
local bodies, state, ready, delayed, seq, done, wake_key, counters, dedups, acks =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local count = (#ARGV - 1) / 6
if count < 1 or count % 1 ~= 0 or #KEYS ~= 10 + count then
  error({err = 'FENCED BADARG publish needs 10 + n keys and 1 + 6n arguments'})
end
local ttl = ARGV[1] == '0' and 0 or arg_int(ARGV[1], 'queue ttl', 0, 1e12)
-- Message i's arguments, checked: id, publish id, priority, delay ms, dedup window ms (a "0", the
-- common case, is taken without a call).
local function message_args(i)
  local base = 6 * i - 4
  local id, publish_id, priority, delay, window = ARGV[base], ARGV[base + 5], ARGV[base + 2], ARGV[base + 3],
    ARGV[base + 4]
  if id == '' or string.find(id, '\n', 1, true) then
    error({err = 'FENCED BADARG message ' .. i .. ': the id must be non-empty and hold no newline'})
  end
  if #publish_id > 128 or not string.find(publish_id, '^[%w_.:@/+=%-]+$') then
    error({err = 'FENCED BADARG message ' .. i .. ': the publish id must be 1-128 letters, digits or _.:@/+=-'})
  end
  return id, publish_id, priority == '0' and 0 or arg_int(priority, 'priority', 0, 9, i),
    delay == '0' and 0 or arg_int(delay, 'delay ms', 0, 1e12, i),
    window == '0' and 0 or arg_int(window, 'dedup window ms', 0, 1e12, i)
end

-- What this call has written so far, and undo(), which takes it back newest first; refuse(reply, key)
-- undoes and refuses with the error a command answered, call() refuses when its command fails. The
-- writes run in a fixed order, so one number says how far they got (`written`: 1 counted, 2 bodies,
-- 3 ready, 4 delayed), `counted` what was counted (nil: the straight path's one message), each
-- message what it wrote of its own (new: HSETNX of its record; beside: its record, and the live one's
-- before it; dedup_set), `pushed` the dedup log's entries. Keys by KEYS[i], not their locals: every
-- upvalue of a closure costs each call, the happy path included.
local messages, stored = {}, {}
local written, counted, pushed = 0, nil, 0
local function undo()
  for _ = 1, pushed do redis.call('LPOP', KEYS[9]) end
  for i = #stored, 1, -1 do
    local m = stored[i]
    if m.dedup_set then redis.call('DEL', m.dedup) end
    if written >= 4 and m.delay > 0 then redis.call('ZREM', KEYS[4], m.stored_id) end
    if written >= 3 and m.delay == 0 then redis.call('ZREM', KEYS[3], m.stored_id) end
    if written >= 2 then redis.call('HDEL', KEYS[1], m.stored_id) end
    if m.created_beside then redis.call('HDEL', KEYS[2], m.stored_id) end
    if m.live_before then redis.call('HSET', KEYS[2], m.id, m.live_before) end
  end
  if written >= 1 then uncount(KEYS[8], counted or {seq = 1, published = 1}) end
  for i = #messages, 1, -1 do
    if messages[i].new then redis.call('HDEL', KEYS[2], messages[i].id) end
  end
end
local function refuse(reply, key)
  undo()
  local kind = string.find(reply.err, 'WRONGTYPE', 1, true) and 'WRONGTYPE' or 'REFUSED'
  error({err = 'FENCED ' .. kind .. ' ' .. key .. ': ' .. reply.err})
end
local function call(command, key, ...)
  local reply = redis.pcall(command, key, ...)
  if type(reply) == 'table' and reply.err then refuse(reply, key) end
  return reply
end

-- The path of one new message without a dedup key (what .delay() sends), straight through: its id
-- not acked within the done window, HSETNX writing its record (the first write), then the rest, each
-- reply checked where it comes (a table from a command that answers a number or a string is its
-- error). Any other case, found before anything is written (an acked id, a live one: HSETNX writes
-- nothing), takes the general path below, which reads again.
if count == 1 then
  local id, publish_id, priority, delay, window = message_args(1)
  if window == 0 then
    local reply = redis.pcall('ZSCORE', done, id)
    if type(reply) == 'table' then refuse(reply, done) end
    if not reply then
      local now_ms = server_time()
      -- The record's priority is its argument's text, checked canonical above.
      reply = redis.pcall('HSETNX', state, id, '0|0|0|0|' .. ARGV[4] .. '|' .. now_ms .. '|0||' .. publish_id)
      if type(reply) == 'table' then refuse(reply, state) end
      if reply == 1 then
        local m = {id = id, stored_id = id, delay = delay, new = true}
        messages[1], stored[1] = m, m
        reply = redis.pcall('BITFIELD', counters, 'INCRBY', 'i64', '#0', 1, 'INCRBY', 'i64', '#1', 1)
        if reply.err then refuse(reply, counters) end
        written = 1
        local n = seq_after(reply[1], 1, counters, seq)
        reply = redis.pcall('HSET', bodies, id, ARGV[3])
        if type(reply) == 'table' then refuse(reply, bodies) end
        written = 2
        if delay > 0 then
          reply = redis.pcall('ZADD', delayed, now_ms + delay, id)
          if type(reply) == 'table' then refuse(reply, delayed) end
        else
          reply = redis.pcall('ZADD', ready, ready_score(priority, n, false), id)
          if type(reply) == 'table' then refuse(reply, ready) end
          written = 3
          reply = redis.pcall('ZADD', wake_key, 0, WAKE_MEMBER)
          if type(reply) == 'table' then refuse(reply, wake_key) end
        end
        if ttl > 0 then keep_expiry(ttl, {bodies, state, ready, delayed, done, wake_key, counters, dedups, acks}) end
        return {1}
      end
    end
  end
end

-- The general path: what it needs beyond the straight one is defined here, not paid for above it.
--- @include "state"
--- @include "publish_ids"
local ids = {}
for i = 1, count do
  local id, publish_id, priority, delay, window = message_args(i)
  messages[i] = {id = id, payload = ARGV[6 * i - 3], publish_id = publish_id, earlier = '', dedup = KEYS[10 + i],
                 priority = priority, delay = delay, window = window}
  ids[i] = id
end

-- Reads. An id acked within the window keeps its publish ids in `acks`: a resend is found there,
-- and a new message of that id starts its own list with them.
local acked = call('ZMSCORE', done, unpack(ids))
for i, m in ipairs(messages) do
  if acked[i] then
    m.earlier = string.match(call('HGET', acks, m.id) or '', '^[^|]*|[^|]*|(.*)$') or ''
    m.known = publish_id_known(m.earlier, m.publish_id)
  end
end
local now_ms = server_time()

-- Each message's record: HSETNX claims the id, or says it is live (then a resend, or one beside it).
local function record_of(m)
  return '0|0|0|0|' .. m.priority .. '|' .. now_ms .. '|0||' .. publish_ids_with(m.earlier, m.publish_id)
end
local duplicates, deduplicated = 0, 0
local replies = {}
for i, m in ipairs(messages) do
  -- A message with a dedup key reads first: a held key must leave nothing written.
  local live = false
  if not m.known then
    if m.window > 0 then
      live = call('HGET', state, m.id)
      if not live then m.held = call('GET', m.dedup) end
    end
    if not live and not m.held then
      if call('HSETNX', state, m.id, record_of(m)) == 0 then
        live = call('HGET', state, m.id)
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
  end
end

-- The sequence numbers and the counts in one BITFIELD (when every message was stored: seq and
-- published, slots #0 and #1 of lua/include/counters.lua); a message stored beside a live one is
-- named after its number.
local counts = {seq = #stored, published = #stored, duplicate_publishes = duplicates,
                deduplicated_publishes = deduplicated}
local last_seq = 0
if #stored == count then
  last_seq = call('BITFIELD', counters, 'INCRBY', 'i64', '#0', count, 'INCRBY', 'i64', '#1', count)[1]
else
  local args, names = counter_args('INCRBY', counts)
  local values = call('BITFIELD', counters, unpack(args))
  if names[1] == 'seq' then last_seq = values[1] end
end
written, counted = 1, counts
local first = #stored > 0 and seq_after(last_seq, #stored, counters, seq) or 0
local fields, ready_entries, delayed_entries = {}, {}, {}
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
      call('HSET', state, m.id, format_state(s))
      m.live_before = raw
    end
    m.created_beside = call('HSET', state, m.stored_id, record_of(m)) == 1
  end
  fields[#fields + 1] = m.stored_id
  fields[#fields + 1] = m.payload
  if m.delay > 0 then
    delayed_entries[#delayed_entries + 1] = now_ms + m.delay
    delayed_entries[#delayed_entries + 1] = m.stored_id
  else
    ready_entries[#ready_entries + 1] = ready_score(m.priority, n, false)
    ready_entries[#ready_entries + 1] = m.stored_id
  end
end

-- The writes, in this order (undo() takes them back in the reverse one).
if #fields > 0 then call('HSET', bodies, unpack(fields)) end
written = 2
if #ready_entries > 0 then call('ZADD', ready, unpack(ready_entries)) end
written = 3
if #delayed_entries > 0 then call('ZADD', delayed, unpack(delayed_entries)) end
written = 4
for _, m in ipairs(stored) do
  if m.window > 0 then
    call('SET', m.dedup, m.stored_id, 'PX', ttl > 0 and math.min(m.window, ttl) or m.window)
    m.dedup_set = true
  end
end
if deduplicated > 0 then
  local entries = {}
  for i, m in ipairs(messages) do
    if replies[i] == 4 then
      entries[#entries + 1] = cjson.encode({key = m.dedup, id = m.id, kept = m.held, at_ms = now_ms})
    end
  end
  call('LPUSH', dedups, unpack(entries))
  pushed = #entries
end
-- The last write: nothing after it can fail, so it needs no undo.
if #ready_entries > 0 then call('ZADD', wake_key, 0, WAKE_MEMBER) end
if pushed > 0 then redis.call('LTRIM', dedups, 0, 999) end
if ttl > 0 then keep_expiry(ttl, {bodies, state, ready, delayed, done, wake_key, counters, dedups, acks}) end
return replies
