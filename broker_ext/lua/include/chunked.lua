-- chunked(call, command, key, list): call(command, key, ...) with the entries of list, in slices of at
-- most CHUNK entries (an even number: pairs stay together), as Lua's unpack stops at about 8000 values.
-- Returns the array replies joined (HMGET) and the integer replies summed (ZREM, HDEL).
local CHUNK = 4000
local function chunked(call, command, key, list)
  local size = #list
  if size == 0 then return {}, 0 end
  if size <= CHUNK then
    -- One slice (every call at prefetch 1): the reply as it comes, no copy.
    local reply = call(command, key, unpack(list, 1, size))
    if type(reply) == 'table' then return reply, 0 end
    return {}, type(reply) == 'number' and reply or 0
  end
  local joined, sum = {}, 0
  for first = 1, #list, CHUNK do
    local reply = call(command, key, unpack(list, first, math.min(first + CHUNK - 1, #list)))
    if type(reply) == 'table' then
      for i = 1, #reply do joined[#joined + 1] = reply[i] end
    elseif type(reply) == 'number' then
      sum = sum + reply
    end
  end
  return joined, sum
end
