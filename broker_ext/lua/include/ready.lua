-- make_ready(ready, seq, id, priority, at_front): put id in the ready set by priority (0 first).
-- Within a priority, the score is priority * 1e14 + seq for the back (FIFO) and - seq for the front
-- (a later one first), so order holds for 10^14 messages per queue.
local function make_ready(ready, seq, id, priority, at_front)
  local n = redis.call('INCR', seq)
  redis.call('ZADD', ready, priority * 1e14 + (at_front and -n or n), id)
end
