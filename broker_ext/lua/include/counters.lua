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
local function counter_args(op, counts, sign)
  local args, names = {}, {}
  for slot, name in ipairs(COUNTERS) do
    local n = counts and counts[name]
    if not counts or (n and n ~= 0) then
      args[#args + 1] = op
      args[#args + 1] = 'i64'
      args[#args + 1] = '#' .. (slot - 1)
      if counts then args[#args + 1] = n * (sign or 1) end
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
