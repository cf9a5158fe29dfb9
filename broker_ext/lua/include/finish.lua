-- Finishing deliveries (acks): what ack.lua does and what claim.lua does for the acks a consumer's next
-- claim carries, in phases, so that a script orders them among its own reads and writes.
-- k names the keys {leases, state, bodies, done, acks, ready, delayed} and k.window (the done window ms).
-- finish_read(k, args, first): reads only. The (id, token, claim) triples of args from first on, each
-- with its reply (1 OK, 2 ALREADY_ACKED, -1 NOT_FOUND, -2 STALE); the current ones in plan.current, with
-- the record `acks` keeps of them. More than one current delivery: their keys' types are checked here
-- (plan.checked, a TYPE per key per call); one is the path of every message at prefetch 1, with no TYPE:
-- its reads come first and its writes refuse a key of the wrong type with nothing written (guard.lua).
-- finish_records(k, plan, now_ms): the done window's records (`done`, `acks`), each undone exactly on a
-- later refusal: a record that was there already (an id acked, published again and acked again within
-- the window) is read before it is replaced.
-- finish_unlease(k, plan): the current deliveries out of `leases`; the last write of a script whose type
-- is not known by then, so nothing after it can be refused. A current delivery not leased (reclaimed,
-- its holder was slow) is looked for in ready and delayed, read first (with several, whose types were
-- checked, each is taken out of both).
-- finish_write(k, plan): the rest: state, bodies, and ready or delayed where finish_unlease found them.
-- finish_prune(k, now_ms, acked_total, acked_now): forget acks older than the window, every PRUNE_EVERY
-- acks of the queue (by its `acked` counter), a bounded number each time, and keep `acks` a hash
-- table (lua/include/hash_table.lua): its records are written and read one by one.
--- @include "state"
--- @include "guard"
--- @include "check_types"
--- @include "chunked"
--- @include "hash_table"
local PRUNE_EVERY = 32
local function finish_read(k, args, first)
  local plan = {replies = {}, current = {}}
  local ids, missing, seen = {}, {}, {}
  for i = first, #args, 3 do ids[#ids + 1] = args[i] end
  if #ids == 0 then return plan end
  local raws = chunked(refusing, 'HMGET', k.state, ids)
  for n, raw in ipairs(raws) do
    if not raw then missing[#missing + 1] = ids[n] end
  end
  local by_id = {}
  if #missing > 0 then
    local records = chunked(refusing, 'HMGET', k.acks, missing)
    for n, id in ipairs(missing) do by_id[id] = records[n] end
  end
  for n, id in ipairs(ids) do
    local token, claim = args[first + 3 * (n - 1) + 1], args[first + 3 * (n - 1) + 2]
    local raw, reply = raws[n], nil
    if raw then
      -- A current record whose token is the text given (as %.0f wrote it) is told by one match; any
      -- other (an older format, a token that differs) is parsed and compared as a number.
      local tk, _, _, _, _, _, _, cl, pb = string.match(raw, STATE_FIELDS)
      local current = tk == token and cl == claim
      if not current then
        local s = parse_state(raw)
        if not s then error({err = 'FENCED CORRUPT ' .. id}) end
        current, pb = string.format('%.0f', s.token) == token and s.claim == claim, s.publish_ids
      end
      if not current then
        reply = -2
      elseif seen[id] then
        reply = 2
      else
        reply = 1
        seen[id] = true
        plan.current[#plan.current + 1] = {id = id, record = token .. '|' .. claim .. '|' .. pb}
      end
    else
      local by = by_id[id]
      if not by or id == TABLE_FIELD then
        reply = -1
      elseif string.match(by, '^[^|]*|[^|]*') == token .. '|' .. claim then
        reply = 2
      else
        reply = -2
      end
    end
    plan.replies[#plan.replies + 1] = reply
  end
  if #plan.current > 1 then
    check_types({{k.leases, 'zset'}, {k.bodies, 'hash'}, {k.done, 'zset'}, {k.acks, 'hash'},
                 {k.ready, 'zset'}, {k.delayed, 'zset'}})
    plan.checked = true
  end
  return plan
end
local function finish_records(k, plan, now_ms)
  if k.window == 0 or #plan.current == 0 then return end
  if plan.checked then
    local scores, fields = {}, {}
    for _, c in ipairs(plan.current) do
      scores[#scores + 1] = now_ms
      scores[#scores + 1] = c.id
      fields[#fields + 1] = c.id
      fields[#fields + 1] = c.record
    end
    chunked(redis.call, 'ZADD', k.done, scores)
    chunked(redis.call, 'HSET', k.acks, fields)
    return
  end
  local c = plan.current[1]
  local forget_done = function(added) if added == 1 then redis.call('ZREM', k.done, c.id) end end
  if guarded(forget_done, 'ZADD', k.done, 'NX', now_ms, c.id) == 0 then
    local old = redis.call('ZSCORE', k.done, c.id)
    redis.call('ZADD', k.done, now_ms, c.id)
    undo_stack[#undo_stack + 1] = function() redis.call('ZADD', k.done, old, c.id) end
  end
  local forget_ack = function(set) if set == 1 then redis.call('HDEL', k.acks, c.id) end end
  if guarded(forget_ack, 'HSETNX', k.acks, c.id, c.record) == 0 then
    local old = redis.call('HGET', k.acks, c.id)
    redis.call('HSET', k.acks, c.id, c.record)
    undo_stack[#undo_stack + 1] = function() redis.call('HSET', k.acks, c.id, old) end
  end
end
local function finish_unlease(k, plan)
  if plan.checked then
    local ids = {}
    for i, c in ipairs(plan.current) do ids[i] = c.id end
    if select(2, chunked(redis.call, 'ZREM', k.leases, ids)) < #ids then
      for _, c in ipairs(plan.current) do c.ready, c.delayed = true, true end
    end
    return
  end
  for _, c in ipairs(plan.current) do
    if guarded(nil, 'ZREM', k.leases, c.id) == 0 then
      c.ready = guarded(nil, 'ZSCORE', k.ready, c.id) and true
      c.delayed = guarded(nil, 'ZSCORE', k.delayed, c.id) and true
    end
  end
end
local function finish_write(k, plan)
  if #plan.current == 0 then return end
  local ids = {}
  local in_ready, in_delayed = {}, {}
  for i, c in ipairs(plan.current) do
    ids[i] = c.id
    if c.ready then in_ready[#in_ready + 1] = c.id end
    if c.delayed then in_delayed[#in_delayed + 1] = c.id end
  end
  chunked(redis.call, 'ZREM', k.ready, in_ready)
  chunked(redis.call, 'ZREM', k.delayed, in_delayed)
  chunked(redis.call, 'HDEL', k.state, ids)
  chunked(redis.call, 'HDEL', k.bodies, ids)
end
local function finish_prune(k, now_ms, acked_total, acked_now)
  if k.window == 0 or acked_now == 0 then return end
  if math.floor(acked_total / PRUNE_EVERY) == math.floor((acked_total - acked_now) / PRUNE_EVERY) then return end
  redis.call('HSETNX', k.acks, TABLE_FIELD, TABLE_VALUE)
  local limit = 4 * PRUNE_EVERY + 2 * acked_now
  local old = redis.call('ZRANGE', k.done, '-inf', now_ms - k.window, 'BYSCORE', 'LIMIT', 0, limit)
  chunked(redis.call, 'ZREM', k.done, old)
  chunked(redis.call, 'HDEL', k.acks, old)
end
