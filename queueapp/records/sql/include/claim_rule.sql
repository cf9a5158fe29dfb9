-- The claim rule, the one place it is written: whether a delivery may claim its key now.
-- Never a key that succeeded or is dead, never an attempt that a retry of the same task superseded
-- while that retry is queued or running; and a fencing token above the one stored, unless the
-- delivery is a later attempt (a retry) of the task that holds the key. A delivery without a
-- broker token (token NULL) takes the stored token plus one.
-- Parameters: token, task_id, retries.
status IN ('queued', 'running', 'failed')
AND NOT (task_id = %(task_id)s AND status IN ('queued', 'running') AND retries > %(retries)s)
AND (
    CAST(%(token)s AS BIGINT) IS NULL
    OR fence_token < %(token)s
    OR (task_id = %(task_id)s AND retries < %(retries)s)
)
