-- arg_int(value, what, min, max, index): value as a whole number in [min, max], or refuse with FENCED
-- BADARG naming `what` (with " of message <index>" when index is given: a text built only to refuse).
-- Only the canonical decimal text of an integer passes ("42", "-7", "0"), by one pattern match: Lua's
-- tonumber() also takes "nan", "inf", "1e400", "5.0", " 5", "0x10", "+5" and "-0", and a "-0" would be
-- written back as "-0", which no reader parses. No leading zeros, no sign on zero; from 15 digits on,
-- the text must also be what %.0f prints for its number (exact below 2^53). Checked before the
-- script's first write, so a bad argument can never leave a half-written message.
local function arg_int(value, what, min, max, index)
  local n = type(value) == 'string' and (value == '0' or string.find(value, '^%-?[1-9]%d*$')) and tonumber(value)
  if not n or n < min or n > max or ((n >= 1e15 or n <= -1e15) and string.format('%.0f', n) ~= value) then
    if index then what = what .. ' of message ' .. index end
    error({err = 'FENCED BADARG ' .. what .. ' must be a whole number in [' .. string.format('%.0f', min)
      .. ', ' .. string.format('%.0f', max) .. '], got ' .. tostring(value)})
  end
  return n
end
