-- check_types(pairs): check_type for each {key, type} pair, before the script's first write.
local function check_types(pairs)
  for _, p in ipairs(pairs) do
    local t = redis.call('TYPE', p[1])['ok']
    if t ~= 'none' and t ~= p[2] then
      error({err = 'FENCED WRONGTYPE ' .. p[1] .. ' is a ' .. t .. ', expected ' .. p[2]})
    end
  end
end
