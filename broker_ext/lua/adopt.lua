#!lua
--[[
adopt: store messages moved over from a stock Kombu Redis transport, once per stock publish.

The second step of a move between two Redis servers (`adopt_take` took each
message out of the stock queues into the source's journal first): every
message is stored as a publish would store it, unless this queue's `adopted`
ledger already holds its stock publish id (moved before, by a run that was
killed before it could clear its journal entry) or the queue knows its
message id. The ledger outlives the message (it expires ARGV[3] ms after the
last move into this queue), so a message moved again after it ran and was
acked, however late, is not stored a second time. No flags: at maxmemory
Redis refuses it before it starts.

KEYS[1] bodies   hash
KEYS[2] state    hash
KEYS[3] ready    zset
KEYS[4] delayed  zset
KEYS[5] seq      string
KEYS[6] done     zset
KEYS[7] signal   list
KEYS[8] stats    hash
KEYS[9] adopted  hash   stock publish id -> moved at ms (server time)

ARGV[1] signal cap
ARGV[2] queue ttl ms (0: the queue does not expire)
ARGV[3] ledger ttl ms: how long `adopted` remembers a move
ARGV[4+5*(i-1) ...] per message i: stock publish id, message id, payload, priority 0-9, delay ms

Reply: one integer per message:
   1 OK         stored, ready (or delayed)
   3 DUPLICATE  the queue already knows this message id: nothing stored
   6 ADOPTED    this stock publish was moved before: nothing stored
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]
--- @include "check_types"
--- @include "arg_int"
--- @include "server_time"
--- @include "keep_expiry"
--- @include "adopt_message"
local count = (#ARGV - 3) / 5
if #KEYS ~= 9 or count < 1 or count ~= math.floor(count) then
  error({err = 'FENCED BADARG adopt needs 9 keys and 3 + 5n arguments'})
end
local k = {bodies = KEYS[1], state = KEYS[2], ready = KEYS[3], delayed = KEYS[4], seq = KEYS[5],
           done = KEYS[6], signal = KEYS[7], stats = KEYS[8], adopted = KEYS[9]}
local signal_cap = arg_int(ARGV[1], 'signal cap', 1, 1e6)
local ttl = arg_int(ARGV[2], 'queue ttl', 0, 1e12)
local ledger_ttl = arg_int(ARGV[3], 'ledger ttl', 1, 1e12)
local messages = {}
for i = 1, count do
  local base = 4 + 5 * (i - 1)
  messages[i] = {publish = ARGV[base], id = ARGV[base + 1], payload = ARGV[base + 2],
                 priority = arg_int(ARGV[base + 3], 'priority of message ' .. i, 0, 9),
                 delay = arg_int(ARGV[base + 4], 'delay ms of message ' .. i, 0, 1e12)}
  if messages[i].publish == '' or messages[i].id == '' or string.find(messages[i].id, '\n', 1, true) then
    error({err = 'FENCED BADARG message ' .. i .. ': a publish id and an id without newline are needed'})
  end
end
check_types({{k.bodies, 'hash'}, {k.state, 'hash'}, {k.ready, 'zset'}, {k.delayed, 'zset'},
             {k.seq, 'string'}, {k.done, 'zset'}, {k.signal, 'list'}, {k.stats, 'hash'},
             {k.adopted, 'hash'}})

local now_ms = server_time()
local replies, stored = {}, 0
for i, m in ipairs(messages) do
  replies[i] = adopt_message(k, m, now_ms)
  if replies[i] == 1 then stored = stored + 1 end
end
redis.call('PEXPIRE', k.adopted, ledger_ttl)
if stored > 0 then
  redis.call('LTRIM', k.signal, 0, signal_cap - 1)
  redis.call('HINCRBY', k.stats, 'published', stored)
  redis.call('HINCRBY', k.stats, 'adopted', stored)
end
keep_expiry(ttl, {k.bodies, k.state, k.ready, k.delayed, k.seq, k.done, k.signal, k.stats})
return replies
