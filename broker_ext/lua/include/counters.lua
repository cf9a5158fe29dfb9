-- The queue's counters: one signed 64-bit slot each in one string (the `counters` key), so that a
-- script adds what it counted with one BITFIELD at its end, and queue_stats reads them all with one
-- BITFIELD_RO. `seq` is the queue's sequence (lua/include/ready.lua); the others count what happened
-- (the admin's, queue_status's and /metrics' counters). An earlier version kept the counts in the
-- hash `stats`, which queue_stats still adds in.
-- counter_args(op, counts, sign): the BITFIELD arguments of op (INCRBY, GET) for the counters in counts
-- (name -> n; all of them for GET), in slot order, and their names in that order;
-- add_counts(key, counts): add them (nothing is sent when nothing was counted), returns name -> value;
-- uncount(key, counts): take them back, to the byte (a guarded write's undo: a counter only ever grows,
-- so the slots at the end that are zero now were not there before).
local COUNTERS = {'seq', 'published', 'claimed', 'acked', 'duplicate_publishes', 'deduplicated_publishes',
  'requeued', 'dead_lettered', 'reclaimed', 'interrupted', 'stray_leases_removed', 'revived', 'purged',
  'adopted'}
-- SLOTS: the BITFIELD offsets of the slots, spelt out (building them was a third of a claim's counting).
local SLOTS = {'#0', '#1', '#2', '#3', '#4', '#5', '#6', '#7', '#8', '#9', '#10', '#11', '#12', '#13'}
local function counter_args(op, counts, sign)
  local args, names, at = {}, {}, 0
  for slot = 1, #COUNTERS do
    local name = COUNTERS[slot]
    local n = counts and counts[name]
    if not counts or (n and n ~= 0) then
      args[at + 1], args[at + 2], args[at + 3] = op, 'i64', SLOTS[slot] or '#' .. (slot - 1)
      at = at + 3
      if counts then
        at = at + 1
        args[at] = n * (sign or 1)
      end
      names[#names + 1] = name
    end
  end
  return args, names
end
local function add_counts(key, counts)
  local args, names = counter_args('INCRBY', counts)
  local values = {}
  if #names > 0 then
    local reply = redis.call('BITFIELD', key, unpack(args))
    for i, name in ipairs(names) do values[name] = reply[i] end
  end
  return values
end
local function uncount(key, counts)
  redis.call('BITFIELD', key, unpack((counter_args('INCRBY', counts, -1))))
  local value = redis.call('GET', key) or ''
  local keep = #value - #value % 8
  while keep > 0 and string.match(string.sub(value, keep - 7, keep), '^%z+$') do keep = keep - 8 end
  if keep == 0 then
    redis.call('DEL', key)
  elseif keep < #value then
    redis.call('SET', key, string.sub(value, 1, keep), 'KEEPTTL')
  end
end
