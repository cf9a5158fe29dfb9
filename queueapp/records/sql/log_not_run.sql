-- log_not_run: a delivery the key did not let run (a suppressed duplicate, a token the database had
-- outranked, deferred or refused as stale): counted on the row, and logged with its verdict.
-- Parameters: key, verdict, detail, suppressed, stale, deferred (each 0 or 1), token (0 without
--   one), token_source, delivery_count, retries, worker, task_id, message_id, queue, now.
-- Returns: outcome_id; no row when the key has no row (deleted: nothing to count on).
UPDATE "queueapp_taskoutcome" SET deliveries = deliveries + 1,
    suppressed_duplicates = suppressed_duplicates + %(suppressed)s,
    stale_refusals = stale_refusals + %(stale)s, deferrals = deferrals + %(deferred)s,
    updated_at = %(now)s
WHERE idempotency_key = %(key)s
RETURNING id AS outcome_id;

INSERT INTO "queueapp_taskdelivery" (outcome_id, fence_token, token_source, verdict, detail,
    delivery_count, retries, worker, task_id, message_id, queue, started_at, finished_at)
VALUES (%(outcome_id)s, %(token)s, %(token_source)s, %(verdict)s, %(detail)s, %(delivery_count)s,
    %(retries)s, %(worker)s, %(task_id)s, %(message_id)s, %(queue)s, %(now)s, %(now)s)
