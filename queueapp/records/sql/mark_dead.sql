-- mark_dead: the broker dead-lettered the message of a key's open row: the row says dead with the
-- reason, unless it moved on since it was read (another status or token); its log gets a line.
-- Parameters: outcome_id, status, fence_token (as read), error, reason, task_id, message_id,
--   queue, now.
-- Changes no row when the row moved on (nothing written).
UPDATE "queueapp_taskoutcome" SET status = 'dead', error = %(error)s, message_id = %(message_id)s,
    lease_deadline = NULL, finished_at = %(now)s, updated_at = %(now)s
WHERE id = %(outcome_id)s AND status = %(status)s AND fence_token = %(fence_token)s;

INSERT INTO "queueapp_taskdelivery" (outcome_id, fence_token, token_source, verdict, detail,
    delivery_count, retries, worker, task_id, message_id, queue, started_at, finished_at)
VALUES (%(outcome_id)s, %(fence_token)s, 'broker', 'dead_lettered', %(reason)s, NULL, 0, '',
    %(task_id)s, %(message_id)s, %(queue)s, %(now)s, %(now)s)
