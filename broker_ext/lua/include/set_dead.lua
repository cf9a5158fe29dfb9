-- set_dead(dead, reasons, id, now_ms, reason, deliveries): move id to the dead-letter set with why.
-- The caller has already taken it out of ready, delayed and leases, and keeps its body and state.
local function set_dead(dead, reasons, id, now_ms, reason, deliveries)
  redis.call('ZADD', dead, now_ms, id)
  redis.call('HSET', reasons, id, cjson.encode({reason = reason, at_ms = now_ms, deliveries = deliveries}))
end
