#!lua
--[[
adopt_take: take messages out of stock Kombu's Redis queues into this server's adoption journal.

The first step of a move between two Redis servers, run on the stock one:
each entry (an element of one queue list, or a delivery tag of the `unacked`
hash) is removed and written to the journal under one field per queue it
goes to, in the same atomic step, so a stock worker can no longer pop it and
nothing is lost if the move stops here. The mover then stores the journal's
messages on the fenced server (`adopt`, idempotent per stock publish) and
deletes their journal fields; a run that was killed finishes the journal
first. An unacked entry is taken only once stock's `restore_visible` would
take it (see lua/include/take_stock.lua). No flags: at maxmemory Redis
refuses it before it starts.

KEYS[1] journal        hash  JSON [queue, publish id] -> the payload to store
KEYS[2] unacked        hash  stock: delivery tag -> JSON [payload, exchange, routing key]
KEYS[3] unacked_index  zset  stock: delivery tag -> delivered at (the worker's clock, seconds)
KEYS[4] list           list  stock: the queue list the entries are in (any key when they are unacked: unused then)

ARGV[1] 'list' or 'unacked': where the entries are
ARGV[2] max age ms of an unacked entry: its visibility timeout (-1: take it whatever its age)
ARGV[3 ...] per entry: the list element or delivery tag, the number n of journal fields (1-64), then n
        pairs: journal field, journal value ('' for the element itself)

Reply: one integer per entry:
   1 OK         taken into the journal
  -1 NOT_FOUND  not there any more (a stock worker popped, acked or restored it): nothing written
  -3 NOT_DUE    unacked, within its visibility timeout: nothing written
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]
--- @include "check_types"
--- @include "arg_int"
--- @include "server_time"
--- @include "take_stock"
local journal = KEYS[1]
if #KEYS ~= 4 or #ARGV < 5 then error({err = 'FENCED BADARG adopt_take needs 4 keys and 5+ arguments'}) end
if ARGV[1] ~= 'list' and ARGV[1] ~= 'unacked' then
  error({err = "FENCED BADARG where must be 'list' or 'unacked'"})
end
local s = {list = ARGV[1] == 'list' and KEYS[4] or nil, unacked = KEYS[2], index = KEYS[3]}
local max_age = arg_int(ARGV[2], 'max age ms', -1, 1e13)
local entries, i = {}, 3
while i <= #ARGV do
  local what = 'entry ' .. (#entries + 1)
  if i + 1 > #ARGV then error({err = 'FENCED BADARG ' .. what .. ' is cut short'}) end
  local n = arg_int(ARGV[i + 1], 'journal fields of ' .. what, 1, 64)
  if i + 1 + 2 * n > #ARGV then error({err = 'FENCED BADARG ' .. what .. ' is cut short'}) end
  entries[#entries + 1] = {source = ARGV[i], first = i + 2, n = n}
  i = i + 2 + 2 * n
end
local types = {{journal, 'hash'}, {s.unacked, 'hash'}, {s.index, 'zset'}}
if s.list then types[#types + 1] = {s.list, 'list'} end
check_types(types)

local now_ms = server_time()
local replies = {}
for j, e in ipairs(entries) do
  local taken = take_stock(s, e.source, max_age, now_ms)
  if type(taken) == 'number' then
    replies[j] = taken
  else
    for f = e.first, e.first + 2 * e.n - 1, 2 do
      redis.call('HSET', journal, ARGV[f], ARGV[f + 1] ~= '' and ARGV[f + 1] or taken)
    end
    replies[j] = 1
  end
end
return replies
