#!lua
--[[
adopt: publish messages moved over from a stock Kombu Redis transport, once per stock publish.

The second step of a move between two Redis servers (`adopt_take` took each
message out of the stock queues into the source's journal first): every
message is published as `publish` publishes it, under its stock publish id,
unless this queue's `adopted` ledger already holds that id (moved before, by
a run that was killed before it could clear its journal entry). The ledger
outlives the message (it expires ARGV[2] ms after the last move into this
queue), so a message moved again after it ran and was acked, however late, is
not stored a second time. No flags: at maxmemory Redis refuses it before it
starts.

KEYS[1]  bodies   hash
KEYS[2]  state    hash
KEYS[3]  ready    zset
KEYS[4]  delayed  zset
KEYS[5]  seq      string the sequence an earlier version kept (read once, when the counters start)
KEYS[6]  done     zset
KEYS[7]  wake     zset
KEYS[8]  counters string (lua/include/counters.lua)
KEYS[9]  dedups   list
KEYS[10] acks     hash
KEYS[11] adopted  hash   stock publish id -> moved at ms (server time)

ARGV[1]  queue ttl ms (0: the queue does not expire)
ARGV[2]  ledger ttl ms: how long `adopted` remembers a move
ARGV[3+5*(i-1) ...] per message i: stock publish id, message id, payload, priority 0-9, delay ms

Reply: one integer per message:
   1 OK         stored, ready (or delayed)
   3 DUPLICATE  the queue knows this publish of this message id: nothing stored
   6 ADOPTED    this stock publish was moved before: nothing stored
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]
--- @include "check_types"
--- @include "arg_int"
--- @include "arg_publish_id"
--- @include "server_time"
--- @include "adopt_message"
local count = (#ARGV - 2) / 5
if #KEYS ~= 11 or count < 1 or count ~= math.floor(count) then
  error({err = 'FENCED BADARG adopt needs 11 keys and 2 + 5n arguments'})
end
local k = adopt_keys(1, arg_int(ARGV[1], 'queue ttl', 0, 1e12))
local ledger_ttl = arg_int(ARGV[2], 'ledger ttl', 1, 1e12)
local messages = {}
for i = 1, count do
  local base = 3 + 5 * (i - 1)
  messages[i] = {publish_id = arg_publish_id(ARGV[base], 'message ' .. i), id = ARGV[base + 1],
                 payload = ARGV[base + 2], window = 0,
                 priority = arg_int(ARGV[base + 3], 'priority of message ' .. i, 0, 9),
                 delay = arg_int(ARGV[base + 4], 'delay ms of message ' .. i, 0, 1e12)}
  if messages[i].id == '' or string.find(messages[i].id, '\n', 1, true) then
    error({err = 'FENCED BADARG message ' .. i .. ': the id must be non-empty and hold no newline'})
  end
end
check_types(adopt_key_types(k))

local now_ms = server_time()
local replies, made_ready = {}, false
local counts = {published = 0, adopted = 0, duplicate_publishes = 0}
for i, m in ipairs(messages) do
  local reply, readied = adopt_message(k, m, now_ms, counts)
  replies[i], made_ready = reply, made_ready or readied
end
adopt_finish(k, counts, made_ready, ledger_ttl)
return replies
