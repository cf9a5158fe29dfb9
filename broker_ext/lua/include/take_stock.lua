-- take_stock(s, source, max_age_ms, now_ms): remove one entry of stock Kombu's Redis transport, if it is
-- still there. s names the stock keys {list, unacked, index}. With s.list, source is an element of that
-- queue list, and the copy nearest its tail (the oldest: the next a stock worker would pop) is removed.
-- Otherwise source is a delivery tag of the `unacked` hash, taken with its `unacked_index` entry only
-- when that entry's score (the consuming worker's clock, in seconds) is at least max_age_ms old by server
-- time, as stock's restore_visible would take it (max_age_ms < 0: whatever its age, an entry without a
-- score too). Returns the value removed, or -1 (gone: a stock worker took, acked or restored it) or
-- -3 (not due: still within the visibility timeout).
local function take_stock(s, source, max_age_ms, now_ms)
  if s.list then
    if redis.call('LREM', s.list, -1, source) == 0 then return -1 end
    return source
  end
  local value = redis.call('HGET', s.unacked, source)
  if not value then return -1 end
  if max_age_ms >= 0 then
    local score = redis.call('ZSCORE', s.index, source)
    if not score or tonumber(score) * 1000 > now_ms - max_age_ms then return -3 end
  end
  redis.call('HDEL', s.unacked, source)
  redis.call('ZREM', s.index, source)
  return value
end
