-- The publish ids a message id has seen: a list, comma-separated, in its state record (and in its done
-- record once acked). A publish id names one publish call (redis-py's resend and Kombu's ensure() retry
-- of that call carry the same one); an entry "P~n" says publish P was stored beside the message, under
-- the id "<message id>~n", because the message was still live. The list keeps the last 8 entries; an
-- empty list is a record written before publish ids existed, which any publish of its id matches.
-- publish_id_known(list, id) -> the stored id it went to ('' for this message's own), or nil;
-- publish_ids_with(list, entry) -> the list with entry added last.
local function publish_id_known(list, id)
  if list == '' then return '' end
  for entry in string.gmatch(list, '[^,]+') do
    local publish, suffix = string.match(entry, '^([^~]*)(.*)$')
    if publish == id then return suffix end
  end
  return nil
end
local function publish_ids_with(list, entry)
  if list == '' then return entry end
  local kept = {}
  for old in string.gmatch(list, '[^,]+') do kept[#kept + 1] = old end
  kept[#kept + 1] = entry
  return table.concat(kept, ',', math.max(1, #kept - 7))
end
