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
Validates every argument and key type before the first write. No flags: at
maxmemory Redis refuses it before it starts.

KEYS[1]  bodies   hash   id -> payload
KEYS[2]  state    hash   id -> state record (see lua/include/state.lua)
KEYS[3]  ready    zset   id -> priority * 1e14 + seq
KEYS[4]  delayed  zset   id -> due ms (server time)
KEYS[5]  seq      string per-queue sequence
KEYS[6]  done     zset   recently acked ids
KEYS[7]  wake     zset   the wake-up marker of blocked consumers (lua/include/wake.lua)
KEYS[8]  stats    hash   counters
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
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]
--- @include "check_types"
--- @include "arg_int"
--- @include "arg_publish_id"
--- @include "server_time"
--- @include "publish_one"
--- @include "wake"
--- @include "keep_expiry"
local bodies, state, ready, delayed, seq, done, wake_key, stats, dedups, acks =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local count = (#ARGV - 1) / 6
if count < 1 or count ~= math.floor(count) or #KEYS ~= 10 + count then
  error({err = 'FENCED BADARG publish needs 10 + n keys and 1 + 6n arguments'})
end
local ttl = arg_int(ARGV[1], 'queue ttl', 0, 1e12)
local types = {{bodies, 'hash'}, {state, 'hash'}, {ready, 'zset'}, {delayed, 'zset'}, {seq, 'string'},
               {done, 'zset'}, {wake_key, 'zset'}, {stats, 'hash'}, {dedups, 'list'}, {acks, 'hash'}}
local messages = {}
for i = 1, count do
  local base = 2 + 6 * (i - 1)
  local id, publish_id = ARGV[base], ARGV[base + 5]
  if id == '' or string.find(id, '\n', 1, true) then
    error({err = 'FENCED BADARG message ' .. i .. ': the id must be non-empty and hold no newline'})
  end
  arg_publish_id(publish_id, 'message ' .. i)
  messages[i] = {
    id = id, payload = ARGV[base + 1], publish_id = publish_id,
    priority = arg_int(ARGV[base + 2], 'priority of message ' .. i, 0, 9),
    delay = arg_int(ARGV[base + 3], 'delay ms of message ' .. i, 0, 1e12),
    window = arg_int(ARGV[base + 4], 'dedup window ms of message ' .. i, 0, 1e12),
    dedup = KEYS[10 + i],
  }
  if messages[i].window > 0 then types[#types + 1] = {messages[i].dedup, 'string'} end
end
check_types(types)

local now_ms = server_time()
local k = {bodies = bodies, state = state, ready = ready, delayed = delayed, seq = seq, done = done,
           acks = acks, dedups = dedups, ttl = ttl}
local replies = {}
local stored, duplicates, deduplicated, made_ready = 0, 0, 0, false
for i, m in ipairs(messages) do
  local reply, readied = publish_one(k, m, now_ms)
  replies[i] = reply
  made_ready = made_ready or readied
  if reply == 1 then stored = stored + 1 elseif reply == 3 then duplicates = duplicates + 1 else
    deduplicated = deduplicated + 1 end
end
if made_ready then wake(wake_key) end
if stored > 0 then redis.call('HINCRBY', stats, 'published', stored) end
if duplicates > 0 then redis.call('HINCRBY', stats, 'duplicate_publishes', duplicates) end
if deduplicated > 0 then redis.call('HINCRBY', stats, 'deduplicated_publishes', deduplicated) end
keep_expiry(ttl, {bodies, state, ready, delayed, seq, done, wake_key, stats, dedups, acks})
return replies
