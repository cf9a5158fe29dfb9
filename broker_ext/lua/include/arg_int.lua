-- arg_int(value, what, min, max): value as a whole number in [min, max], or refuse with FENCED BADARG.
-- Lua's tonumber() accepts "nan", "inf" and "1e400": a finite whole number in range is checked here,
-- before the script's first write, so a bad argument can never leave a half-written message.
local function arg_int(value, what, min, max)
  local n = tonumber(value)
  if n == nil or n ~= n or n == math.huge or n == -math.huge or n ~= math.floor(n)
      or n < min or n > max then
    error({err = 'FENCED BADARG ' .. what .. ' must be a whole number in [' .. string.format('%.0f', min)
      .. ', ' .. string.format('%.0f', max) .. '], got ' .. tostring(value)})
  end
  return n
end
