-- wake(key): leave the queue's wake-up marker for the consumers blocked on it (BZPOPMIN). It is one
-- member of a sorted set, so however many publishes set it, it never grows: one consumer takes it and
-- claims, and a claim that leaves messages ready sets it again for the next consumer.
local WAKE_MEMBER = 'ready'
local function wake(key)
  redis.call('ZADD', key, 0, WAKE_MEMBER)
end
