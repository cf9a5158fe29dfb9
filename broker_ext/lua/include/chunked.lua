-- chunked(call, command, key, list): call(command, key, ...) with the entries of list, in slices of at
-- most CHUNK entries (an even number: pairs stay together), as Lua's unpack stops at about 8000 values.
-- Returns the array replies joined (HMGET) and the integer replies summed (ZREM, HDEL).
local CHUNK = 4000
local function chunked(call, command, key, list)
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
