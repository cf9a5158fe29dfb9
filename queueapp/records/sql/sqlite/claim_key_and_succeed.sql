-- claim_key_and_succeed: the key claim written with the success, at the end of the body's
-- transaction (which holds the write lock since its BEGIN): the row goes to succeeded under the
-- token the body was shown if the claim rule still holds (the body may have changed its own row),
-- then the delivery's log row is inserted with its verdict, executed.
-- Parameters: outcome_id, claimed_token, token, task_id, retries, worker, message_id, queue,
--   delivery_count, started, updated, finished, args, kwargs, result.
-- Changes no row when the row changed since the check (nothing written).
UPDATE "queueapp_taskoutcome" SET
--- @include "claim_assignments"
    , status = 'succeeded', finished_at = %(finished)s, lease_deadline = NULL, error = '',
    traceback = '', result = %(result)s
WHERE id = %(outcome_id)s AND fence_token < %(claimed_token)s AND (%(queue)s = '' OR queue = %(queue)s)
    AND (
--- @include "claim_rule"
    );

INSERT INTO "queueapp_taskdelivery" (outcome_id, fence_token, token_source, verdict, detail,
    delivery_count, retries, worker, task_id, message_id, queue, started_at, finished_at)
VALUES (%(outcome_id)s, %(claimed_token)s,
--- @include "token_source"
    , 'executed', '', %(delivery_count)s, %(retries)s, %(worker)s, %(task_id)s, %(message_id)s,
    %(queue)s, %(started)s, %(finished)s)
