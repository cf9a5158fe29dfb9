-- fail: a claimed delivery whose body raised (its writes rolled back): its log row gets its verdict,
-- retried or failed, and the error; the row goes back to queued for the next attempt (retrying) or
-- to failed, if the claim is still the row's. The row is found by its primary key
-- whatever the statistics say (succeed.sql says why the status test is written IS TRUE).
-- Parameters: outcome_id, claimed_token, log_id, status, verdict, error, traceback, finished
--   (NULL when retrying), now.
UPDATE "queueapp_taskdelivery" SET verdict = %(verdict)s, detail = %(error)s, finished_at = %(now)s
WHERE id = %(log_id)s;

UPDATE "queueapp_taskoutcome" SET status = %(status)s, error = %(error)s, traceback = %(traceback)s,
    finished_at = %(finished)s, lease_deadline = NULL, updated_at = %(now)s
WHERE id = %(outcome_id)s AND fence_token = %(claimed_token)s AND (status = 'running') IS TRUE
