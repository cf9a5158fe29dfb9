-- What a claim writes on the outcome row besides its state (running, or succeeded with the
-- success): the token and the attempt, who runs it, and the delivery's arguments on a row recorded
-- without them. Every value is read from the row before the update.
-- Parameters: token, retries, worker, task_id, message_id, started, updated, args, kwargs.
fence_token =
--- @include "claimed_token"
, retries = %(retries)s,
attempts = attempts + 1, deliveries = deliveries + 1,
worker = %(worker)s, task_id = %(task_id)s, message_id = %(message_id)s,
first_started_at = COALESCE(first_started_at, %(started)s), last_started_at = %(started)s,
updated_at = %(updated)s,
args = CASE WHEN args = '[]' AND kwargs = '{}' THEN %(args)s ELSE args END,
kwargs = CASE WHEN args = '[]' AND kwargs = '{}' THEN %(kwargs)s ELSE kwargs END
