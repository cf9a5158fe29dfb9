-- reclaim_expired(k, now_ms, limit, lease, limits): expired leases (by server time) back to ready,
-- or to the dead-letter set. k names the keys {leases, state, ready, counters, seq, dead, reasons,
-- reclaims} (seq: the sequence an earlier version kept);
-- limits is {max_deliveries, max_interruptions}. A delivery whose lease its worker had extended
-- (the deadline is past the one the claim set: the worker was alive and holding it, then stopped)
-- counts as interrupted; one never extended (its worker stopped at once, as a poison message makes
-- it) is charged against max_deliveries. Each has its own cap. A reclaimed message goes to the front
-- of its priority and keeps its token and claim, so a holder that was only slow can still ack or
-- extend it until the next claim fences it off. Every expiry is logged to `reclaims` (capped).
-- Reads first, writes after. Returns {reclaimed, strays, interrupted, dead = {id, reason, ...}}.
--- @include "state"
--- @include "ready"
--- @include "set_dead"
local function reclaim_expired(k, now_ms, now_us, limit, lease, limits)
  local result = {reclaimed = 0, strays = 0, interrupted = 0, dead = {}}
  local expired = redis.call('ZRANGE', k.leases, '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, limit, 'WITHSCORES')
  if #expired == 0 then return result end
  local found = {}
  for i = 1, #expired, 2 do
    found[#found + 1] = {id = expired[i], deadline = tonumber(expired[i + 1]),
                         raw = redis.call('HGET', k.state, expired[i])}
  end
  for _, e in ipairs(found) do
    redis.call('ZREM', k.leases, e.id)
    local s = parse_state(e.raw)
    local reason = nil
    if not e.raw then
      result.strays = result.strays + 1
    elseif not s then
      redis.call('HSET', k.state, e.id, string.format('%.0f', now_us) .. '|0|0|0|0|' .. now_ms .. '|0|')
      reason = 'undeliverable: corrupt state'
      s = {deliveries = 0}
    else
      local extended = s.first_deadline > 0 and e.deadline > s.first_deadline
      redis.call('LPUSH', k.reclaims, cjson.encode({id = e.id, token = string.format('%.0f', s.token),
        claim = s.claim, deliveries = s.deliveries, deadline_ms = e.deadline, first_deadline_ms = s.first_deadline,
        last_extended_ms = e.deadline - lease, extended = extended, at_ms = now_ms}))
      if extended then
        s.interrupted = s.interrupted + 1
        result.interrupted = result.interrupted + 1
      else
        s.charged = s.charged + 1
      end
      if s.charged >= limits[1] then
        reason = 'lease expired on delivery ' .. s.deliveries .. ', its worker never extended it ('
          .. s.charged .. ' charged deliveries, max_deliveries ' .. limits[1] .. ')'
      elseif s.interrupted >= limits[2] then
        reason = 'lease expired on delivery ' .. s.deliveries .. ', interrupted ' .. s.interrupted
          .. ' times (max_interruptions ' .. limits[2] .. ')'
      else
        make_ready(k.ready, k.counters, k.seq, e.id, s.priority, true)
        result.reclaimed = result.reclaimed + 1
      end
      redis.call('HSET', k.state, e.id, format_state(s))
    end
    if reason then
      set_dead(k.dead, k.reasons, e.id, now_ms, reason, s.deliveries)
      result.dead[#result.dead + 1] = e.id
      result.dead[#result.dead + 1] = reason
    end
  end
  redis.call('LTRIM', k.reclaims, 0, 999)
  return result
end
