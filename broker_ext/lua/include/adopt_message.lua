-- The adopt scripts' part that publishes: a fenced queue's keys, and each message moved over from stock
-- Kombu published once per stock publish.
-- adopt_keys(first, ttl): the queue's keys from KEYS[first] on, in the order of the adopt headers
-- (bodies, state, ready, delayed, seq, done, wake, stats, dedups, acks, adopted), as publish_one takes them.
-- adopt_key_types(k): those keys with the types check_types expects.
-- adopt_message(k, m, now_ms): publish m (a message as publish_one takes it, its publish id the stock
-- message's) unless the `adopted` ledger has its publish id; the ledger records it first, so moving the
-- same stock message again, however late (after its ack, past the done window), publishes nothing.
-- Returns publish_one's reply and whether it made a message ready, or 6 (ADOPTED: moved before), false.
-- adopt_finish(k, stored, made_ready, ledger_ttl): the ledger's expiry, the wake-up, the counters, x-expires.
--- @include "publish_one"
--- @include "wake"
--- @include "keep_expiry"
local function adopt_keys(first, ttl)
  return {bodies = KEYS[first], state = KEYS[first + 1], ready = KEYS[first + 2], delayed = KEYS[first + 3],
          seq = KEYS[first + 4], done = KEYS[first + 5], wake = KEYS[first + 6], stats = KEYS[first + 7],
          dedups = KEYS[first + 8], acks = KEYS[first + 9], adopted = KEYS[first + 10], ttl = ttl}
end
local function adopt_key_types(k)
  return {{k.bodies, 'hash'}, {k.state, 'hash'}, {k.ready, 'zset'}, {k.delayed, 'zset'}, {k.seq, 'string'},
          {k.done, 'zset'}, {k.wake, 'zset'}, {k.stats, 'hash'}, {k.dedups, 'list'}, {k.acks, 'hash'},
          {k.adopted, 'hash'}}
end
local function adopt_message(k, m, now_ms)
  if redis.call('HEXISTS', k.adopted, m.publish_id) == 1 then return 6, false end
  redis.call('HSET', k.adopted, m.publish_id, now_ms)
  return publish_one(k, m, now_ms)
end
local function adopt_finish(k, stored, made_ready, ledger_ttl)
  redis.call('PEXPIRE', k.adopted, ledger_ttl)
  if made_ready then wake(k.wake) end
  if stored > 0 then
    redis.call('HINCRBY', k.stats, 'published', stored)
    redis.call('HINCRBY', k.stats, 'adopted', stored)
  end
  keep_expiry(k.ttl, {k.bodies, k.state, k.ready, k.delayed, k.seq, k.done, k.wake, k.stats, k.dedups, k.acks})
end
