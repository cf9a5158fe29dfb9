-- adopt_message(k, m, now_ms): publish a message moved over from stock Kombu, once per stock publish.
-- k names the queue's keys as publish_one takes them, plus `adopted`; m is a message as publish_one takes
-- it, its publish id the stock message's. The `adopted` ledger records that id first, so moving the same
-- stock message again, however late (after its ack, past the done window), publishes nothing. Returns
-- publish_one's reply and whether it made a message ready, or 6 (ADOPTED: moved before) and false.
--- @include "publish_one"
local function adopt_message(k, m, now_ms)
  if redis.call('HEXISTS', k.adopted, m.publish_id) == 1 then return 6, false end
  redis.call('HSET', k.adopted, m.publish_id, now_ms)
  return publish_one(k, m, now_ms)
end
