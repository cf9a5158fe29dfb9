#!lua
--[[
report_consumer: a lease keeper says which consumer it keeps alive, stamped with Redis server time.

One hash for every consumer (not per queue): the admin's Workers view reads it
to show live consumers, what each holds and when it last extended. Entries of
consumers not seen for ARGV[3] ms are removed here, a few per call, so a
killed worker's entry does not stay forever (readers skip them too); ARGV[2] =
'' removes this consumer's own entry (a clean stop). No flags: at maxmemory
Redis refuses it before it starts, and the lease keeper carries on.

KEYS[1] consumers  hash  consumer id -> JSON {report..., seen_ms, extended_ms}

ARGV[1] consumer id
ARGV[2] report: a JSON object (with "extended": true when the keeper has just extended its
        leases, which sets extended_ms to now; else the last extended_ms is kept), or '' to remove it
ARGV[3] forget after ms

Reply: server time in ms.
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]
--- @include "check_types"
--- @include "arg_int"
--- @include "server_time"
local consumers = KEYS[1]
if #KEYS ~= 1 or #ARGV ~= 3 then error({err = 'FENCED BADARG report_consumer needs 1 key and 3 arguments'}) end
local id, report = ARGV[1], ARGV[2]
local forget_after = arg_int(ARGV[3], 'forget after ms', 1, 1e12)
check_types({{consumers, 'hash'}})
local entry = nil
if report ~= '' then
  local ok, decoded = pcall(cjson.decode, report)
  if not ok or type(decoded) ~= 'table' then error({err = 'FENCED BADARG the report must be a JSON object'}) end
  entry = decoded
end

local now_ms = server_time()
if entry then
  entry.seen_ms = now_ms
  if entry.extended then
    entry.extended_ms = now_ms
  else
    local ok, before = pcall(cjson.decode, redis.call('HGET', consumers, id) or '')
    if ok and type(before) == 'table' then entry.extended_ms = before.extended_ms end
  end
  entry.extended = nil
  redis.call('HSET', consumers, id, cjson.encode(entry))
else
  redis.call('HDEL', consumers, id)
end
-- Forget consumers gone silent: a few, drawn at random, per call.
local fields = redis.call('HRANDFIELD', consumers, 5, 'WITHVALUES')
for i = 1, #fields, 2 do
  local ok, other = pcall(cjson.decode, fields[i + 1])
  if not ok or type(other) ~= 'table' or not tonumber(other.seen_ms) or now_ms - other.seen_ms > forget_after then
    redis.call('HDEL', consumers, fields[i])
  end
end
return now_ms
