-- arg_publish_id(value, what): value as a publish id (1-128 letters, digits or _.:@/+=-), or refuse with
-- FENCED BADARG, before the script's first write.
local function arg_publish_id(value, what)
  if #value > 128 or not string.match(value, '^[%w_.:@/+=%-]+$') then
    error({err = 'FENCED BADARG ' .. what .. ': the publish id must be 1-128 letters, digits or _.:@/+=-'})
  end
  return value
end
