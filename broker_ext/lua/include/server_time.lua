-- server_time(): Redis server time as (milliseconds, microseconds): every lease, due time and token epoch.
local function server_time()
  local t = redis.call('TIME')
  local seconds, micros = tonumber(t[1]), tonumber(t[2])
  return seconds * 1000 + math.floor(micros / 1000), seconds * 1000000 + micros
end
