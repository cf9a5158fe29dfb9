-- known_message(state, done, id): whether the queue stores id, or acked it within the done window:
-- a publish of it again is a resend, stored once (DUPLICATE).
-- store_message(k, m, now_ms): store message m {id, payload, priority, delay} with a fresh state record,
-- ready (a wake-up left on the signal list, which the caller trims) or delayed until now_ms + m.delay.
-- k names the queue's {bodies, state, ready, delayed, seq, signal}. The caller checked the id is not known.
--- @include "ready"
local function known_message(state, done, id)
  return redis.call('HEXISTS', state, id) == 1 or redis.call('ZSCORE', done, id) ~= false
end
local function store_message(k, m, now_ms)
  redis.call('HSET', k.bodies, m.id, m.payload)
  redis.call('HSET', k.state, m.id, '0|0|0|0|' .. m.priority .. '|' .. now_ms .. '|0|')
  if m.delay > 0 then
    redis.call('ZADD', k.delayed, now_ms + m.delay, m.id)
  else
    make_ready(k.ready, k.seq, m.id, m.priority, false)
    redis.call('LPUSH', k.signal, '1')
  end
end
