-- adopt_message(k, m, now_ms): store a message moved over from stock Kombu, once per stock publish.
-- k names the queue's {bodies, state, ready, delayed, seq, done, signal, adopted}; m is {publish, id,
-- payload, priority, delay}, where publish is the stock message's publish id. The `adopted` ledger records
-- it first, so moving the same stock message again, however late (after its ack, past the done window),
-- stores nothing. Returns 1 stored, 3 DUPLICATE (the queue knows the message id), 6 ADOPTED (moved before).
--- @include "store_message"
local function adopt_message(k, m, now_ms)
  if redis.call('HEXISTS', k.adopted, m.publish) == 1 then return 6 end
  redis.call('HSET', k.adopted, m.publish, now_ms)
  if known_message(k.state, k.done, m.id) then return 3 end
  store_message(k, m, now_ms)
  return 1
end
