-- claim_key: the key claim, committed before the body: the row says running under the claimed
-- token, then the delivery's log row is inserted (verdict started). SQLite rewrites an index
-- whenever its column is assigned, even to its own value, so the queue is a condition here, not an
-- assignment: a delivery from another queue is claimed after move_queue.sql.
-- Parameters: key, token, task_id, retries, worker, message_id, queue, delivery_count, started,
--   updated, lease_deadline, args, kwargs.
-- Returns: outcome_id, attempts, claimed_token, log_id; no row when the claim rule refuses.
UPDATE "queueapp_taskoutcome" SET
--- @include "claim_assignments"
    , status = 'running', finished_at = NULL, lease_deadline = %(lease_deadline)s
WHERE idempotency_key = %(key)s AND (%(queue)s = '' OR queue = %(queue)s) AND (
--- @include "claim_rule"
)
RETURNING id AS outcome_id, attempts, fence_token AS claimed_token;

INSERT INTO "queueapp_taskdelivery" (outcome_id, fence_token, token_source, verdict, detail,
    delivery_count, retries, worker, task_id, message_id, queue, started_at, lease_deadline)
VALUES (%(outcome_id)s, %(claimed_token)s,
--- @include "token_source"
    , 'started', '', %(delivery_count)s, %(retries)s, %(worker)s, %(task_id)s, %(message_id)s,
    %(queue)s, %(started)s, %(lease_deadline)s)
RETURNING id AS log_id
