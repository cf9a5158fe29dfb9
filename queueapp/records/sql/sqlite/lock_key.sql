-- lock_key: the key's row, for a claim claim_key refused; the transaction's BEGIN IMMEDIATE holds
-- the database's write lock, so the row cannot change before the transaction ends.
-- Parameters: key.
-- Returns: outcome_id, status, fence_token, task_id, retries, queue, result; no row when the key
--   has none.
SELECT id AS outcome_id, status, fence_token, task_id, retries, queue, result
FROM "queueapp_taskoutcome" WHERE idempotency_key = %(key)s
