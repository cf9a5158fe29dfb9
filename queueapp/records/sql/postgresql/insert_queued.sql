-- insert_queued: the queued rows of published keys that have none yet, in one statement however
-- many; a key that has a row keeps it as it is (a late record never changes a claimed row). On its
-- own (asynchronous) it commits without waiting for its WAL flush: the rows are for ops to see what
-- is queued, and a worker's claim creates a missing one.
-- Parameters: rows (a JSON array of [key, task_name, args, kwargs, queue, task_id, eta,
--   queued_at]: timestamps as text, eta null when none), asynchronous.
-- Returns: the id of each row inserted.
WITH flush AS (
    SELECT set_config('synchronous_commit', 'off', true) WHERE %(asynchronous)s
)
INSERT INTO "queueapp_taskoutcome" (idempotency_key, task_name, args, kwargs, queue, task_id, eta,
    queued_at, updated_at, status, attempts, deliveries, fence_token, retries, worker, message_id,
    error, traceback, suppressed_duplicates, stale_refusals, deferrals)
SELECT r->>0, r->>1, r->2, r->3, r->>4, r->>5, (r->>6)::timestamptz, (r->>7)::timestamptz,
    (r->>7)::timestamptz, 'queued', 0, 0, 0, 0, '', '', '', '', 0, 0, 0
FROM jsonb_array_elements(%(rows)s::jsonb) AS r
WHERE NOT %(asynchronous)s OR EXISTS (SELECT 1 FROM flush)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id
