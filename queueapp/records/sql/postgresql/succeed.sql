-- succeed: the success of a key claim committed before the body, in the body's transaction: the row
-- says succeeded only if its token is still the claim's and it is still running; the log row of the
-- delivery says executed. The row is found by its primary key whatever the statistics say: written
-- as status = 'running', the test could be served by the lease index, (status, lease_deadline),
-- which statistics taken while no row ran make look as cheap, and which holds an entry for every
-- running row; IS TRUE is the same test, which no index serves.
-- Parameters: outcome_id, claimed_token, log_id, result, finished.
-- Returns: outcome_id; no row when the claim is no longer the row's (nothing written).
WITH done AS (
    UPDATE "queueapp_taskoutcome" SET status = 'succeeded', result = %(result)s, error = '',
        traceback = '', finished_at = %(finished)s, lease_deadline = NULL, updated_at = %(finished)s
    WHERE id = %(outcome_id)s AND fence_token = %(claimed_token)s AND (status = 'running') IS TRUE
    RETURNING id
), logged AS (
    UPDATE "queueapp_taskdelivery" SET verdict = 'executed', finished_at = %(finished)s
    WHERE id = %(log_id)s AND EXISTS (SELECT 1 FROM done)
    RETURNING id
)
SELECT done.id AS outcome_id FROM done LEFT JOIN logged ON true
