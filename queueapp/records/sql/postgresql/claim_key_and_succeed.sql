-- claim_key_and_succeed: the key claim written with the success, at the end of the body's
-- transaction: the row goes from what check_claim saw to succeeded, under the token the body was
-- shown, only if the claim rule still holds (decided again under the row lock, on the row as
-- committed by anyone meanwhile); the delivery's log row is inserted with its verdict, executed.
-- Parameters: outcome_id, claimed_token, token, task_id, retries, worker, message_id, queue,
--   delivery_count, started, updated, finished, args, kwargs, result.
-- Changes no row when the row changed since the check (nothing written).
WITH done AS (
    UPDATE "queueapp_taskoutcome" SET
--- @include "claim_assignments"
        , status = 'succeeded', finished_at = %(finished)s, lease_deadline = NULL, error = '',
        traceback = '', result = %(result)s,
        queue = CASE WHEN %(queue)s = '' THEN queue ELSE %(queue)s END
    WHERE id = %(outcome_id)s AND fence_token < %(claimed_token)s AND (
--- @include "claim_rule"
    )
    RETURNING id
)
INSERT INTO "queueapp_taskdelivery" (outcome_id, fence_token, token_source, verdict, detail,
    delivery_count, retries, worker, task_id, message_id, queue, started_at, finished_at)
SELECT id, %(claimed_token)s,
--- @include "token_source"
    , 'executed', '', %(delivery_count)s, %(retries)s, %(worker)s, %(task_id)s, %(message_id)s,
    %(queue)s, %(started)s, %(finished)s
FROM done
