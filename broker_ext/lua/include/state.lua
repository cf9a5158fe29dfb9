-- The state record of a message (hash `state`, one field per message id):
--   "token|deliveries|charged|interrupted|priority|queued_ms|first_deadline_ms|claim|publish_ids"
-- token: the current delivery's fencing token; deliveries: claims so far (every one);
-- charged: deliveries spent against max_deliveries; interrupted: lease expiries of deliveries a live
-- worker had extended (not charged); first_deadline_ms: the lease deadline the claim set (an extension
-- pushes the lease past it); claim: id of the claim that leased it ('' before the first claim);
-- publish_ids: the publishes of this message id (lua/include/publish_ids.lua).
-- Records written before the later fields existed ("token|deliveries|priority|queued_ms", and the
-- eight fields without publish ids) still parse, with no publish ids.
-- parse_state(text) -> table, or nil when missing or not a state record; format_state(table) -> text.
-- STATE_FIELDS: the pattern of the current record, its nine fields captured as text.
local STATE_FIELDS = '^(%d+)|(%d+)|(%d+)|(%d+)|(%d)|(%d+)|(%d+)|(%w*)|([%w_.:@/+=,~%-]*)$'
local function parse_state(text)
  if not text then return nil end
  local tk, dl, ch, it, pr, qu, fd, cl, pb = string.match(text, STATE_FIELDS)
  if not tk then
    tk, dl, ch, it, pr, qu, fd, cl = string.match(text, '^(%d+)|(%d+)|(%d+)|(%d+)|(%d)|(%d+)|(%d+)|(%w*)$')
    pb = ''
  end
  if tk then
    return {token = tonumber(tk), deliveries = tonumber(dl), charged = tonumber(ch),
            interrupted = tonumber(it), priority = tonumber(pr), queued = qu,
            first_deadline = tonumber(fd), claim = cl, publish_ids = pb}
  end
  tk, dl, pr, qu = string.match(text, '^(%d+)|(%d+)|(%d)|(%d+)$')
  if not tk then return nil end
  return {token = tonumber(tk), deliveries = tonumber(dl), charged = tonumber(dl), interrupted = 0,
          priority = tonumber(pr), queued = qu, first_deadline = 0, claim = '', publish_ids = ''}
end
local function format_state(s)
  return string.format('%.0f|%d|%d|%d|%d|%s|%.0f|%s|%s', s.token, s.deliveries, s.charged, s.interrupted,
    s.priority, s.queued, s.first_deadline, s.claim, s.publish_ids)
end
