-- lock_key: the key's row, locked until the transaction ends, for a claim claim_key refused.
-- Parameters: key.
-- Returns: outcome_id, status, fence_token, task_id, retries, queue, result; no row when the key
--   has none.
SELECT id AS outcome_id, status, fence_token, task_id, retries, queue, result
FROM "queueapp_taskoutcome" WHERE idempotency_key = %(key)s
FOR UPDATE
