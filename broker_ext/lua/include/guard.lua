-- guarded(undo, command, key, ...): redis.call that undoes, on an error, what the guarded calls before
-- it wrote, newest first, and then refuses with "FENCED WRONGTYPE <key>: ..." (or FENCED REFUSED).
-- For a script that checks no key types up front (they cost a TYPE each, on every call): its first
-- write fails before anything is written, and every later write passes undo(reply), a function that
-- puts back what that command changed. On the happy path it costs nothing: redis.pcall is
-- redis.call returning an error instead of raising it. A read passes no undo: guarded(nil, ...).
-- undo_writes(): undo every guarded write so far, newest first, and forget them (a script that changes
-- its mind without refusing: a resent claim).
-- refusing(command, key, ...): guarded(nil, command, key, ...), for a command with nothing to undo: a
-- read, or the last write whose key's type was not known yet (it fails before it writes).
-- check_types_guarded(pairs): check_types (lua/include/check_types.lua) after guarded writes: a key of
-- the wrong type undoes them before it refuses.
-- add_counts_guarded(key, counts): add_counts (lua/include/counters.lua) as a guarded write, taken
-- back to the byte by uncount should a later write be refused; returns name -> value.
--- @include "counters"
local undo_stack = {}
local function undo_writes()
  for i = #undo_stack, 1, -1 do undo_stack[i]() end
  undo_stack = {}
end
local function guarded(undo, command, key, ...)
  local reply = redis.pcall(command, key, ...)
  if type(reply) == 'table' and reply.err then
    undo_writes()
    local kind = string.find(reply.err, 'WRONGTYPE', 1, true) and 'WRONGTYPE' or 'REFUSED'
    error({err = 'FENCED ' .. kind .. ' ' .. key .. ': ' .. reply.err})
  end
  if undo then undo_stack[#undo_stack + 1] = function() undo(reply) end end
  return reply
end
local function refusing(command, key, ...)
  return guarded(nil, command, key, ...)
end
local function check_types_guarded(pairs)
  for _, p in ipairs(pairs) do
    local t = redis.call('TYPE', p[1])['ok']
    if t ~= 'none' and t ~= p[2] then
      undo_writes()
      error({err = 'FENCED WRONGTYPE ' .. p[1] .. ' is a ' .. t .. ', expected ' .. p[2]})
    end
  end
end
local function add_counts_guarded(key, counts)
  local args, names = counter_args('INCRBY', counts)
  local values = {}
  if #names > 0 then
    local reply = guarded(function() uncount(key, counts) end, 'BITFIELD', key, unpack(args))
    for i, name in ipairs(names) do values[name] = reply[i] end
  end
  return values
end
