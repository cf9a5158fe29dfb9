#!lua
--[[
adopt_local: move messages from stock Kombu's Redis queues into a fenced queue of the same Redis.

Stock and fenced keys in one database: each entry (an element of one queue
list, or a delivery tag of the `unacked` hash) is taken out of the stock keys
and published in the fenced queue in one atomic step, so a move stopped at any
point has moved each message entirely or not at all. An unacked entry is taken
only once stock's `restore_visible` would take it (lua/include/take_stock.lua);
publishing follows `adopt` (once per stock publish id, ledger in `adopted`). No
flags: at maxmemory Redis refuses it before it starts.

KEYS[1]  bodies         hash
KEYS[2]  state          hash
KEYS[3]  ready          zset
KEYS[4]  delayed        zset
KEYS[5]  seq            string  the sequence an earlier version kept (read only)
KEYS[6]  done           zset
KEYS[7]  wake           zset
KEYS[8]  counters       string  (lua/include/counters.lua)
KEYS[9]  dedups         list
KEYS[10] acks           hash
KEYS[11] adopted        hash  stock publish id -> moved at ms (server time)
KEYS[12] unacked        hash  stock: delivery tag -> JSON [payload, exchange, routing key]
KEYS[13] unacked_index  zset  stock: delivery tag -> delivered at (the worker's clock, seconds)
KEYS[14] list           list  stock: the queue list the entries are in (any key when they are unacked: unused then)

ARGV[1] queue ttl ms (0: the queue does not expire)
ARGV[2] ledger ttl ms: how long `adopted` remembers a move
ARGV[3] 'list' or 'unacked': where the entries are
ARGV[4] max age ms of an unacked entry: its visibility timeout (-1: take it whatever its age)
ARGV[5+6*(i-1) ...] per entry i: the list element or delivery tag, stock publish id, message id,
        payload ('' for the list element itself), priority 0-9, delay ms

Reply: one integer per entry:
   1 OK         moved: taken out of the stock keys and stored, ready (or delayed)
   3 DUPLICATE  taken out; the queue knew this publish of this message id, so nothing stored
   6 ADOPTED    taken out; this stock publish was moved before, so nothing stored
  -1 NOT_FOUND  not there any more (a stock worker popped, acked or restored it): nothing written
  -3 NOT_DUE    unacked, within its visibility timeout: nothing written
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]
--- @include "check_types"
--- @include "arg_int"
--- @include "arg_publish_id"
--- @include "server_time"
--- @include "take_stock"
--- @include "adopt_message"
local count = (#ARGV - 4) / 6
if #KEYS ~= 14 or count < 1 or count ~= math.floor(count) then
  error({err = 'FENCED BADARG adopt_local needs 14 keys and 4 + 6n arguments'})
end
if ARGV[3] ~= 'list' and ARGV[3] ~= 'unacked' then
  error({err = "FENCED BADARG where must be 'list' or 'unacked'"})
end
local k = adopt_keys(1, arg_int(ARGV[1], 'queue ttl', 0, 1e12))
local s = {list = ARGV[3] == 'list' and KEYS[14] or nil, unacked = KEYS[12], index = KEYS[13]}
local ledger_ttl = arg_int(ARGV[2], 'ledger ttl', 1, 1e12)
local max_age = arg_int(ARGV[4], 'max age ms', -1, 1e13)
local entries = {}
for i = 1, count do
  local base = 5 + 6 * (i - 1)
  entries[i] = {source = ARGV[base], publish_id = arg_publish_id(ARGV[base + 1], 'entry ' .. i),
                id = ARGV[base + 2], payload = ARGV[base + 3], window = 0,
                priority = arg_int(ARGV[base + 4], 'priority of entry ' .. i, 0, 9),
                delay = arg_int(ARGV[base + 5], 'delay ms of entry ' .. i, 0, 1e12)}
  if entries[i].id == '' or string.find(entries[i].id, '\n', 1, true) then
    error({err = 'FENCED BADARG entry ' .. i .. ': the id must be non-empty and hold no newline'})
  end
end
local types = adopt_key_types(k)
types[#types + 1] = {s.unacked, 'hash'}
types[#types + 1] = {s.index, 'zset'}
if s.list then types[#types + 1] = {s.list, 'list'} end
check_types(types)

local now_ms = server_time()
local replies, made_ready = {}, false
local counts = {published = 0, adopted = 0, duplicate_publishes = 0}
for i, e in ipairs(entries) do
  local taken = take_stock(s, e.source, max_age, now_ms)
  if type(taken) == 'number' then
    replies[i] = taken
  else
    if e.payload == '' then e.payload = taken end
    local reply, readied = adopt_message(k, e, now_ms, counts)
    replies[i], made_ready = reply, made_ready or readied
  end
end
adopt_finish(k, counts, made_ready, ledger_ttl)
return replies
