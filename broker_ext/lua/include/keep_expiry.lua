-- keep_expiry(ttl, keys): a queue declared with x-expires keeps its expiry on every key a script wrote,
-- also on a key the script created anew (Redis deletes an emptied set, and a write creates it without a TTL).
local function keep_expiry(ttl, keys)
  if ttl > 0 then
    for _, key in ipairs(keys) do redis.call('PEXPIRE', key, ttl) end
  end
end
