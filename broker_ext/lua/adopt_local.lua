#!lua
--[[
adopt_local: move messages from stock Kombu's Redis queues into a fenced queue of the same Redis.

Stock and fenced keys in one database: each entry (an element of one queue
list, or a delivery tag of the `unacked` hash) is taken out of the stock keys
and stored in the fenced queue in one atomic step, so a move stopped at any
point has moved each message entirely or not at all. An unacked entry is taken
only once stock's `restore_visible` would take it (lua/include/take_stock.lua);
storing follows `adopt` (once per stock publish id, ledger in `adopted`). No
flags: at maxmemory Redis refuses it before it starts.

KEYS[1] bodies         hash
KEYS[2] state          hash
KEYS[3] ready          zset
KEYS[4] delayed        zset
KEYS[5] seq            string
KEYS[6] done           zset
KEYS[7] signal         list
KEYS[8] stats          hash
KEYS[9] adopted        hash  stock publish id -> moved at ms (server time)
KEYS[10] unacked       hash  stock: delivery tag -> JSON [payload, exchange, routing key]
KEYS[11] unacked_index zset  stock: delivery tag -> delivered at (the worker's clock, seconds)
KEYS[12] list          list  stock: the queue list the entries are in (any key when they are unacked: unused then)

ARGV[1] signal cap
ARGV[2] queue ttl ms (0: the queue does not expire)
ARGV[3] ledger ttl ms: how long `adopted` remembers a move
ARGV[4] 'list' or 'unacked': where the entries are
ARGV[5] max age ms of an unacked entry: its visibility timeout (-1: take it whatever its age)
ARGV[6+6*(i-1) ...] per entry i: the list element or delivery tag, stock publish id, message id,
        payload ('' for the list element itself), priority 0-9, delay ms

Reply: one integer per entry:
   1 OK         moved: taken out of the stock keys and stored, ready (or delayed)
   3 DUPLICATE  taken out; the queue already knew this message id, so nothing stored
   6 ADOPTED    taken out; this stock publish was moved before, so nothing stored
  -1 NOT_FOUND  not there any more (a stock worker popped, acked or restored it): nothing written
  -3 NOT_DUE    unacked, within its visibility timeout: nothing written
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]
--- @include "check_types"
--- @include "arg_int"
--- @include "server_time"
--- @include "keep_expiry"
--- @include "take_stock"
--- @include "adopt_message"
local count = (#ARGV - 5) / 6
if #KEYS ~= 12 or count < 1 or count ~= math.floor(count) then
  error({err = 'FENCED BADARG adopt_local needs 12 keys and 5 + 6n arguments'})
end
if ARGV[4] ~= 'list' and ARGV[4] ~= 'unacked' then
  error({err = "FENCED BADARG where must be 'list' or 'unacked'"})
end
local k = {bodies = KEYS[1], state = KEYS[2], ready = KEYS[3], delayed = KEYS[4], seq = KEYS[5],
           done = KEYS[6], signal = KEYS[7], stats = KEYS[8], adopted = KEYS[9]}
local s = {list = ARGV[4] == 'list' and KEYS[12] or nil, unacked = KEYS[10], index = KEYS[11]}
local signal_cap = arg_int(ARGV[1], 'signal cap', 1, 1e6)
local ttl = arg_int(ARGV[2], 'queue ttl', 0, 1e12)
local ledger_ttl = arg_int(ARGV[3], 'ledger ttl', 1, 1e12)
local max_age = arg_int(ARGV[5], 'max age ms', -1, 1e13)
local entries = {}
for i = 1, count do
  local base = 6 + 6 * (i - 1)
  entries[i] = {source = ARGV[base], publish = ARGV[base + 1], id = ARGV[base + 2],
                payload = ARGV[base + 3],
                priority = arg_int(ARGV[base + 4], 'priority of entry ' .. i, 0, 9),
                delay = arg_int(ARGV[base + 5], 'delay ms of entry ' .. i, 0, 1e12)}
  if entries[i].publish == '' or entries[i].id == '' or string.find(entries[i].id, '\n', 1, true) then
    error({err = 'FENCED BADARG entry ' .. i .. ': a publish id and an id without newline are needed'})
  end
end
local types = {{k.bodies, 'hash'}, {k.state, 'hash'}, {k.ready, 'zset'}, {k.delayed, 'zset'},
               {k.seq, 'string'}, {k.done, 'zset'}, {k.signal, 'list'}, {k.stats, 'hash'},
               {k.adopted, 'hash'}, {s.unacked, 'hash'}, {s.index, 'zset'}}
if s.list then types[#types + 1] = {s.list, 'list'} end
check_types(types)

local now_ms = server_time()
local replies, stored = {}, 0
for i, e in ipairs(entries) do
  local taken = take_stock(s, e.source, max_age, now_ms)
  if type(taken) == 'number' then
    replies[i] = taken
  else
    if e.payload == '' then e.payload = taken end
    replies[i] = adopt_message(k, e, now_ms)
    if replies[i] == 1 then stored = stored + 1 end
  end
end
redis.call('PEXPIRE', k.adopted, ledger_ttl)
if stored > 0 then
  redis.call('LTRIM', k.signal, 0, signal_cap - 1)
  redis.call('HINCRBY', k.stats, 'published', stored)
  redis.call('HINCRBY', k.stats, 'adopted', stored)
end
keep_expiry(ttl, {k.bodies, k.state, k.ready, k.delayed, k.seq, k.done, k.signal, k.stats})
return replies
