-- The adopt scripts' part that publishes: a fenced queue's keys, and each message moved over from stock
-- Kombu published once per stock publish.
-- adopt_keys(first, ttl): the queue's keys from KEYS[first] on, in the order of the adopt headers
-- (bodies, state, ready, delayed, seq, done, wake, counters, dedups, acks, adopted).
-- adopt_key_types(k): those keys with the types check_types expects (seq is only read).
-- adopt_message(k, m, now_ms, counts): publish message m {id, payload, priority, delay, publish_id} as
-- publish.lua publishes one (which see: publish ids, a message stored beside a live one of its id),
-- message by message where publish.lua batches, unless the `adopted` ledger has its publish id (the stock
-- message's): the ledger records it first, so moving the same stock message again, however late (after
-- its ack, past the done window), publishes nothing. Adds to counts; returns 1 (stored) or 3 (DUPLICATE:
-- the queue knows this publish) or 6 (ADOPTED: moved before), and whether it made a message ready.
-- adopt_finish(k, counts, made_ready, ledger_ttl): the ledger's expiry, the counts, the wake-up, x-expires.
--- @include "state"
--- @include "publish_ids"
--- @include "ready"
--- @include "wake"
--- @include "keep_expiry"
local function adopt_keys(first, ttl)
  return {bodies = KEYS[first], state = KEYS[first + 1], ready = KEYS[first + 2], delayed = KEYS[first + 3],
          seq = KEYS[first + 4], done = KEYS[first + 5], wake = KEYS[first + 6], counters = KEYS[first + 7],
          dedups = KEYS[first + 8], acks = KEYS[first + 9], adopted = KEYS[first + 10], ttl = ttl}
end
local function adopt_key_types(k)
  return {{k.bodies, 'hash'}, {k.state, 'hash'}, {k.ready, 'zset'}, {k.delayed, 'zset'}, {k.done, 'zset'},
          {k.wake, 'zset'}, {k.counters, 'string'}, {k.dedups, 'list'}, {k.acks, 'hash'}, {k.adopted, 'hash'}}
end
local function adopt_message(k, m, now_ms, counts)
  if redis.call('HEXISTS', k.adopted, m.publish_id) == 1 then return 6, false end
  redis.call('HSET', k.adopted, m.publish_id, now_ms)
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
    counts.duplicate_publishes = counts.duplicate_publishes + 1
    return 3, false
  end
  local id = m.id
  if raw then
    local n = seq_after(add_counts(k.counters, {seq = 1}).seq, 1, k.counters, k.seq)
    id = m.id .. '~' .. string.format('%.0f', n)
    if live then
      live.publish_ids = publish_ids_with(live.publish_ids, m.publish_id .. string.sub(id, #m.id + 1))
      redis.call('HSET', k.state, m.id, format_state(live))
    end
  end
  redis.call('HSET', k.bodies, id, m.payload)
  redis.call('HSET', k.state, id, '0|0|0|0|' .. m.priority .. '|' .. now_ms .. '|0||'
    .. publish_ids_with(earlier, m.publish_id))
  counts.published, counts.adopted = counts.published + 1, counts.adopted + 1
  if m.delay > 0 then
    redis.call('ZADD', k.delayed, now_ms + m.delay, id)
    return 1, false
  end
  make_ready(k.ready, k.counters, k.seq, id, m.priority, false)
  return 1, true
end
local function adopt_finish(k, counts, made_ready, ledger_ttl)
  redis.call('PEXPIRE', k.adopted, ledger_ttl)
  add_counts(k.counters, counts)
  if made_ready then wake(k.wake) end
  keep_expiry(k.ttl, {k.bodies, k.state, k.ready, k.delayed, k.done, k.wake, k.counters, k.dedups, k.acks})
end
