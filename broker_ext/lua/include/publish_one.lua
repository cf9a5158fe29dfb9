-- publish_one(k, m, now_ms): the publish of one message, as publish.lua describes it; returns its reply
-- (1 stored, 3 DUPLICATE, 4 DEDUPLICATED) and whether it made a message ready (the caller wakes).
-- k names the queue's {bodies, state, ready, delayed, seq, done, acks, dedups}; m is {id, payload,
-- priority, delay, window, dedup, publish_id}. A resend finds its publish id in the record of its
-- message id, live or acked within the done window; a new message of an id acked within the window keeps
-- that record's publish ids in its own; one of an id still live goes beside it, listed in its record.
--- @include "state"
--- @include "publish_ids"
--- @include "ready"
local function publish_one(k, m, now_ms)
  local raw = redis.call('HGET', k.state, m.id)
  local live = raw and parse_state(raw)
  local known, earlier = nil, ''
  if live then
    known = publish_id_known(live.publish_ids, m.publish_id)
  elseif not raw and redis.call('ZSCORE', k.done, m.id) then
    earlier = string.match(redis.call('HGET', k.acks, m.id) or '', '^[^|]*|[^|]*|(.*)$') or ''
    known = publish_id_known(earlier, m.publish_id)
  end
  if known then
    return 3, false
  end
  if m.window > 0 and redis.call('EXISTS', m.dedup) == 1 then
    redis.call('LPUSH', k.dedups, cjson.encode({
      key = m.dedup, id = m.id, kept = redis.call('GET', m.dedup), at_ms = now_ms}))
    redis.call('LTRIM', k.dedups, 0, 999)
    return 4, false
  end
  local id = m.id
  if raw then
    id = m.id .. '~' .. redis.call('INCR', k.seq)
    if live then
      live.publish_ids = publish_ids_with(live.publish_ids, m.publish_id .. string.sub(id, #m.id + 1))
      redis.call('HSET', k.state, m.id, format_state(live))
    end
  end
  redis.call('HSET', k.bodies, id, m.payload)
  redis.call('HSET', k.state, id, '0|0|0|0|' .. m.priority .. '|' .. now_ms .. '|0||'
    .. publish_ids_with(earlier, m.publish_id))
  if m.window > 0 then
    redis.call('SET', m.dedup, id, 'PX', k.ttl > 0 and math.min(m.window, k.ttl) or m.window)
  end
  if m.delay > 0 then
    redis.call('ZADD', k.delayed, now_ms + m.delay, id)
    return 1, false
  end
  make_ready(k.ready, k.seq, id, m.priority, false)
  return 1, true
end
