-- arg_int(value, what, min, max): value as a whole number in [min, max], or refuse with FENCED BADARG.
-- Only the canonical decimal text of an integer passes ("42", "-7", "0"): Lua's tonumber() also takes
-- "nan", "inf", "1e400", "5.0", " 5", "0x10" and "-0", and a "-0" would be written back as "-0", which
-- no reader parses. The text must be what %.0f prints for its number (no leading zeros, no sign on
-- zero, exact below 2^53), checked before the script's first write, so a bad argument can never
-- leave a half-written message.
-- The common case, a short canonical text (no sign or leading zero, at most 15 digits: exact), is
-- told by its pattern alone; string.format, the slow part, only checks the others.
local function arg_int(value, what, min, max)
  local n = type(value) == 'string' and string.match(value, '^%-?%d+$') and tonumber(value)
  local canonical = n and (#value <= 15 and string.match(value, '^[1-9]%d*$') or value == '0')
  if not canonical and n and value ~= '-0' and string.format('%.0f', n) == value then canonical = true end
  if not canonical or n < min or n > max then
    error({err = 'FENCED BADARG ' .. what .. ' must be a whole number in [' .. string.format('%.0f', min)
      .. ', ' .. string.format('%.0f', max) .. '], got ' .. tostring(value)})
  end
  return n
end
