-- succeed: the success of a key claim committed before the body, in the body's transaction: the row
-- says succeeded only if its token is still the claim's and it is still running; then the log row
-- of the delivery says executed.
-- Parameters: outcome_id, claimed_token, log_id, result, finished.
-- Changes no row when the claim is no longer the row's (nothing written).
UPDATE "queueapp_taskoutcome" SET status = 'succeeded', result = %(result)s, error = '',
    traceback = '', finished_at = %(finished)s, lease_deadline = NULL, updated_at = %(finished)s
WHERE id = %(outcome_id)s AND fence_token = %(claimed_token)s AND status = 'running';

UPDATE "queueapp_taskdelivery" SET verdict = 'executed', finished_at = %(finished)s
WHERE id = %(log_id)s
