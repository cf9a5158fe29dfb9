-- ready_score(priority, n, at_front): the ready set's score of a message with sequence number n, by
-- priority (0 first): priority * 1e14 + n at the back (FIFO), - n at the front (a later one first),
-- so order holds for 10^14 messages per queue.
-- seq_after(last, count, counters, legacy): the first of count numbers ending at last, the `seq`
-- counter just moved there; a queue whose counters start at that move continues the sequence an
-- earlier version kept in the string `legacy` (read without failing: it is only a hint).
-- make_ready(ready, counters, legacy, id, priority, at_front): put id in ready with the next number.
--- @include "counters"
local function ready_score(priority, n, at_front)
  return priority * 1e14 + (at_front and -n or n)
end
local function seq_after(last, count, counters, legacy)
  if last == count then
    local before = tonumber(redis.pcall('GET', legacy))
    if before and before > 0 then last = redis.call('BITFIELD', counters, 'INCRBY', 'i64', '#0', before)[1] end
  end
  return last - count + 1
end
local function make_ready(ready, counters, legacy, id, priority, at_front)
  local n = seq_after(add_counts(counters, {seq = 1}).seq, 1, counters, legacy)
  redis.call('ZADD', ready, ready_score(priority, n, at_front), id)
end
