-- wake(signal, cap): leave a wake-up for a consumer blocked on the queue's signal list, at most cap.
local function wake(signal, cap)
  redis.call('LPUSH', signal, '1')
  redis.call('LTRIM', signal, 0, cap - 1)
end
