#!lua flags=allow-oom
--[[
claim: take up to N ready messages and lease them, in one atomic step.

Due delayed messages are promoted first (by Redis server time). Each claimed
message gets a fencing token strictly greater than any it had before:
max(previous token + 1, server time in microseconds), so tokens keep growing
across requeues, restarts and failovers (the clock term carries them past a
counter that lost its last writes). The lease deadline is server time plus
the lease, never a worker's clock.

A claim carries a request id: the ids it leased are remembered for a while, and
the same request sent again (a client retry after a lost reply) returns the
same deliveries instead of leasing more.

With no_ack = 1 the messages are removed at once (consumers that never ack,
such as remote-control reply queues).

KEYS[1] ready  KEYS[2] delayed  KEYS[3] leases  KEYS[4] bodies  KEYS[5] state
KEYS[6] seq    KEYS[7] stats    KEYS[8] claim request key (string)

ARGV[1] count (>= 1)   ARGV[2] lease ms   ARGV[3] request ttl ms
ARGV[4] no_ack (0/1)   ARGV[5] max delayed messages to promote

Reply: a flat array, four entries per delivery: id, token, deliveries, payload.
Errors (nothing written): "FENCED WRONGTYPE <key>", "FENCED BADARG <what>".
--]]

local function check_type(key, want)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= want then
    error({err = 'FENCED WRONGTYPE ' .. key .. ' is a ' .. t .. ', expected ' .. want})
  end
end

local count, lease = tonumber(ARGV[1]), tonumber(ARGV[2])
local request_ttl, no_ack, promote = tonumber(ARGV[3]), ARGV[4] == '1', tonumber(ARGV[5])
if #KEYS ~= 8 or not count or count < 1 or not lease or lease <= 0
    or not request_ttl or not promote then
  error({err = 'FENCED BADARG claim needs 8 keys, count >= 1, lease > 0, ttl and promote limit'})
end
local types = {'zset', 'zset', 'zset', 'hash', 'hash', 'string', 'hash', 'string'}
for i = 1, 8 do check_type(KEYS[i], types[i]) end

local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local now_us = tonumber(now[1]) * 1000000 + tonumber(now[2])
local out = {}

local function split_state(st)
  local token, deliveries, priority, queued = string.match(st, '^(%d+)|(%d+)|(%d+)|(%d+)$')
  return tonumber(token), tonumber(deliveries), priority, queued
end

-- A resent request: hand back what the first one leased, if still held by it.
local previous = redis.call('GET', KEYS[8])
if previous then
  for id in string.gmatch(previous, '[^\n]+') do
    local st = redis.call('HGET', KEYS[5], id)
    local body = redis.call('HGET', KEYS[4], id)
    if st and body and redis.call('ZSCORE', KEYS[3], id) then
      local token, deliveries = split_state(st)
      out[#out + 1] = id
      out[#out + 1] = string.format('%.0f', token)
      out[#out + 1] = deliveries
      out[#out + 1] = body
    end
  end
  return out
end

-- Delayed messages that are due become ready, in due order.
if promote > 0 then
  local due = redis.call('ZRANGE', KEYS[2], '-inf', now_ms, 'BYSCORE', 'LIMIT', 0, promote)
  for _, id in ipairs(due) do
    local st = redis.call('HGET', KEYS[5], id)
    redis.call('ZREM', KEYS[2], id)
    if st then
      local _, _, priority = split_state(st)
      local seq = redis.call('INCR', KEYS[6])
      redis.call('ZADD', KEYS[1], tonumber(priority) * 1e12 + seq, id)
    end
  end
end

local popped = redis.call('ZPOPMIN', KEYS[1], count)
local ids, orphans = {}, 0
for i = 1, #popped, 2 do
  local id = popped[i]
  local st = redis.call('HGET', KEYS[5], id)
  local body = redis.call('HGET', KEYS[4], id)
  if st and body then
    local token, deliveries, priority, queued = split_state(st)
    token = math.max(token + 1, now_us)
    deliveries = deliveries + 1
    local token_text = string.format('%.0f', token)
    if no_ack then
      redis.call('HDEL', KEYS[4], id)
      redis.call('HDEL', KEYS[5], id)
    else
      redis.call('HSET', KEYS[5], id, token_text .. '|' .. deliveries .. '|' .. priority .. '|' .. queued)
      redis.call('ZADD', KEYS[3], now_ms + lease, id)
      ids[#ids + 1] = id
    end
    out[#out + 1] = id
    out[#out + 1] = token_text
    out[#out + 1] = deliveries
    out[#out + 1] = body
  else
    -- An id without its body or state cannot be delivered: drop the stray entry.
    redis.call('HDEL', KEYS[4], id)
    redis.call('HDEL', KEYS[5], id)
    orphans = orphans + 1
  end
end
if #ids > 0 and request_ttl > 0 then
  redis.call('SET', KEYS[8], table.concat(ids, '\n'), 'PX', request_ttl)
end
if #out > 0 then redis.call('HINCRBY', KEYS[7], 'claimed', #out / 4) end
if orphans > 0 then redis.call('HINCRBY', KEYS[7], 'orphans_dropped', orphans) end
return out
