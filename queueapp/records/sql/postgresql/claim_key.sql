-- claim_key: the key claim, committed before the body: the row says running under the claimed
-- token, and the delivery's log row is inserted (verdict started), in one statement. On its own
-- (asynchronous) the statement is its transaction and commits without waiting for its WAL flush:
-- the success, or any synchronous commit after it, flushes it.
-- Parameters: key, token, task_id, retries, worker, message_id, queue, delivery_count, started,
--   updated, lease_deadline, args, kwargs, asynchronous.
-- Returns: outcome_id, attempts, claimed_token, log_id; no row when the claim rule refuses.
WITH flush AS (
    SELECT set_config('synchronous_commit', 'off', true) WHERE %(asynchronous)s
), claimed AS (
    UPDATE "queueapp_taskoutcome" SET
--- @include "claim_assignments"
        , status = 'running', finished_at = NULL, lease_deadline = %(lease_deadline)s,
        queue = CASE WHEN %(queue)s = '' THEN queue ELSE %(queue)s END
    WHERE idempotency_key = %(key)s AND (NOT %(asynchronous)s OR EXISTS (SELECT 1 FROM flush)) AND (
--- @include "claim_rule"
    )
    RETURNING id, attempts, fence_token
), logged AS (
    INSERT INTO "queueapp_taskdelivery" (outcome_id, fence_token, token_source, verdict, detail,
        delivery_count, retries, worker, task_id, message_id, queue, started_at, lease_deadline)
    SELECT id, fence_token,
--- @include "token_source"
        , 'started', '', %(delivery_count)s, %(retries)s, %(worker)s, %(task_id)s, %(message_id)s,
        %(queue)s, %(started)s, %(lease_deadline)s
    FROM claimed
    RETURNING id
)
SELECT claimed.id AS outcome_id, claimed.attempts, claimed.fence_token AS claimed_token, logged.id AS log_id
FROM claimed, logged
