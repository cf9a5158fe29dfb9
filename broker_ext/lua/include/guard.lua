-- guarded(undo, command, key, ...): redis.call that undoes, on an error, what the guarded calls before
-- it wrote, newest first, and then refuses with "FENCED WRONGTYPE <key>: ..." (or FENCED REFUSED).
-- For a script that checks no key types up front (they cost a TYPE each, on every call): its first
-- write fails before anything is written, and every later write passes undo(reply), a function that
-- puts back what that command changed. On the happy path it costs nothing: redis.pcall is
-- redis.call returning an error instead of raising it.
local undo_stack = {}
local function guarded(undo, command, key, ...)
  local reply = redis.pcall(command, key, ...)
  if type(reply) == 'table' and reply.err then
    for i = #undo_stack, 1, -1 do undo_stack[i]() end
    local kind = string.find(reply.err, 'WRONGTYPE', 1, true) and 'WRONGTYPE' or 'REFUSED'
    error({err = 'FENCED ' .. kind .. ' ' .. key .. ': ' .. reply.err})
  end
  if undo then undo_stack[#undo_stack + 1] = function() undo(reply) end end
  return reply
end
