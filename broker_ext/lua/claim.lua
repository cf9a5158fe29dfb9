#!lua flags=allow-oom
--[[
claim: take up to N ready messages and lease them, in one atomic step.

Due delayed messages are promoted first (by Redis server time). Each claimed
message gets a fencing token strictly greater than any it had before:
max(previous token + 1, server time in microseconds + its place in this claim),
so tokens keep growing
across requeues, restarts and failovers (the clock term carries them past a
counter that lost its last writes). The lease deadline is server time plus
the lease, never a worker's clock.

A claim carries a request id: the id and token of each message it leased are
remembered for a while, and the same request sent again (a client retry after
a lost reply) returns those deliveries whose token is still the one it handed
out, instead of leasing more (never a delivery someone else got since).

A ready message that cannot be delivered (its body or state is missing, or
its state is not "token|deliveries|priority|queued_ms") is not dropped: it
goes to the dead-letter set with the reason, for an operator to look at.

With no_ack = 1 the messages are removed at once (consumers that never ack,
such as remote-control reply queues).

Consumers block on the signal list, and a publish pushes one wake-up per
message but keeps at most a few: so while ready messages remain after this
claim, the claim leaves a wake-up in the list for the next consumer.

Each step reads and checks first, then writes only what passed.

KEYS[1] ready  KEYS[2] delayed  KEYS[3] leases  KEYS[4] bodies  KEYS[5] state
KEYS[6] seq    KEYS[7] stats    KEYS[8] claim request key (string)
KEYS[9] dead   KEYS[10] reasons  KEYS[11] signal (list)

ARGV[1] count (>= 1)   ARGV[2] lease ms   ARGV[3] request ttl ms
ARGV[4] no_ack (0/1)   ARGV[5] max delayed messages to promote

Reply: a flat array, four entries per delivery: id, token, deliveries, payload.
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]

local count, lease = tonumber(ARGV[1]), tonumber(ARGV[2])
local request_ttl, no_ack, promote = tonumber(ARGV[3]), ARGV[4] == '1', tonumber(ARGV[5])
if #KEYS ~= 11 or not count or count < 1 or not lease or lease <= 0
    or not request_ttl or not promote then
  error({err = 'FENCED BADARG claim needs 11 keys, count >= 1, lease > 0, ttl and promote limit'})
end

local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local now_us = tonumber(now[1]) * 1000000 + tonumber(now[2])
local out = {}

-- A resent request: hand back what the first one leased, where that lease is still its own.
local previous = redis.call('GET', KEYS[8])
if previous then
  for id, token in string.gmatch(previous, '([^\n]+)|(%d+)') do
    local state = parse_state(redis.call('HGET', KEYS[5], id))
    local body = redis.call('HGET', KEYS[4], id)
    if state and body and state.token == tonumber(token) and redis.call('ZSCORE', KEYS[3], id) then
      out[#out + 1] = id
      out[#out + 1] = token
      out[#out + 1] = state.deliveries
      out[#out + 1] = body
    end
  end
  return out
end

-- Due delayed messages, read and checked, then made ready (or set aside when corrupt).
local due = {}
if promote > 0 then
  due = redis.call('ZRANGE', KEYS[2], '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, promote)
end
-- An idle queue (what every consumer polls for, once a second) costs these reads and nothing more.
if #due == 0 and redis.call('ZCARD', KEYS[1]) == 0 then return out end
local types = {'zset', 'zset', 'zset', 'hash', 'hash', 'string', 'hash', 'string', 'zset', 'hash', 'list'}
for i = 1, 11 do check_type(KEYS[i], types[i]) end
local due_states = {}
for i, id in ipairs(due) do due_states[i] = parse_state(redis.call('HGET', KEYS[5], id)) end

local dead = 0
local function dead_letter(id, state, reason)
  redis.call('ZADD', KEYS[9], now_ms, id)
  redis.call('HSET', KEYS[10], id, cjson.encode({
    reason = reason, at_ms = now_ms, deliveries = state and state.deliveries or 0}))
  if not state then
    -- A state revive can read: priority 0, a fresh token.
    redis.call('HSET', KEYS[5], id, string.format('%.0f', now_us) .. '|0|0|' .. now_ms)
  end
  dead = dead + 1
end

for i, id in ipairs(due) do
  redis.call('ZREM', KEYS[2], id)
  local state = due_states[i]
  if state then
    local seq = redis.call('INCR', KEYS[6])
    redis.call('ZADD', KEYS[1], state.priority * 1e14 + seq, id)
  else
    dead_letter(id, nil, 'undeliverable: missing or corrupt state')
  end
end

-- The ready messages this claim takes, read and checked, then leased (or set aside).
local peeked = redis.call('ZRANGE', KEYS[1], 0, count - 1)
local peeked_states, peeked_bodies = {}, {}
for i, id in ipairs(peeked) do
  peeked_states[i] = parse_state(redis.call('HGET', KEYS[5], id))
  peeked_bodies[i] = redis.call('HGET', KEYS[4], id)
end
local leased = {}
for i, id in ipairs(peeked) do
  redis.call('ZREM', KEYS[1], id)
  local state, body = peeked_states[i], peeked_bodies[i]
  if not state then
    dead_letter(id, nil, 'undeliverable: missing or corrupt state')
  elseif not body then
    dead_letter(id, state, 'undeliverable: body missing')
  else
    -- "+ i - 1": messages claimed together get distinct tokens (two of them may share a key).
    local token = string.format('%.0f', math.max(state.token + 1, now_us + i - 1))
    local deliveries = state.deliveries + 1
    if no_ack then
      redis.call('HDEL', KEYS[4], id)
      redis.call('HDEL', KEYS[5], id)
    else
      redis.call('HSET', KEYS[5], id, token .. '|' .. deliveries .. '|' .. state.priority .. '|' .. state.queued)
      redis.call('ZADD', KEYS[3], now_ms + lease, id)
      leased[#leased + 1] = id .. '|' .. token
    end
    out[#out + 1] = id
    out[#out + 1] = token
    out[#out + 1] = deliveries
    out[#out + 1] = body
  end
end
if #peeked > 0 and redis.call('LLEN', KEYS[11]) == 0 and redis.call('ZCARD', KEYS[1]) > 0 then
  redis.call('LPUSH', KEYS[11], '1')
end
if #leased > 0 and request_ttl > 0 then
  redis.call('SET', KEYS[8], table.concat(leased, '\n'), 'PX', request_ttl)
end
if #out > 0 then redis.call('HINCRBY', KEYS[7], 'claimed', #out / 4) end
if dead > 0 then redis.call('HINCRBY', KEYS[7], 'dead_lettered', dead) end
return out
