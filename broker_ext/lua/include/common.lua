--[[
common: helpers every script gets, inserted by broker_ext/scripts.py after the
script's shebang line (Redis runs one chunk per script; this is not an
operation of its own).
--]]

-- Refuse (nothing written yet) when a key exists with another type than the script needs.
local function check_type(key, want)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= want then
    error({err = 'FENCED WRONGTYPE ' .. key .. ' is a ' .. t .. ', expected ' .. want})
  end
end

-- "token|deliveries|priority|queued_ms" -> table, or nil when it is not that (or missing).
local function parse_state(st)
  if not st then return nil end
  local token, deliveries, priority, queued = string.match(st, '^(%d+)|(%d+)|(%d)|(%d+)$')
  if not token then return nil end
  return {token = tonumber(token), deliveries = tonumber(deliveries), priority = tonumber(priority),
          queued = queued}
end
