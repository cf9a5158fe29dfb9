-- insert_queued: the queued rows of published keys that have none yet, in one statement however
-- many; a key that has a row keeps it as it is (a late record never changes a claimed row).
-- Parameters: rows (a JSON array of [key, task_name, args, kwargs, queue, task_id, eta,
--   queued_at]: timestamps as Django stores them, eta null when none).
-- Returns: the id of each row inserted.
INSERT INTO "queueapp_taskoutcome" (idempotency_key, task_name, args, kwargs, queue, task_id, eta,
    queued_at, updated_at, status, attempts, deliveries, fence_token, retries, worker, message_id,
    error, traceback, suppressed_duplicates, stale_refusals, deferrals)
SELECT json_extract(r.value, '$[0]'), json_extract(r.value, '$[1]'), json_extract(r.value, '$[2]'),
    json_extract(r.value, '$[3]'), json_extract(r.value, '$[4]'), json_extract(r.value, '$[5]'),
    json_extract(r.value, '$[6]'), json_extract(r.value, '$[7]'), json_extract(r.value, '$[7]'),
    'queued', 0, 0, 0, 0, '', '', '', '', 0, 0, 0
FROM json_each(%(rows)s) AS r
WHERE true
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id
