-- check_claim: whether the claim rule lets a delivery claim its key, without writing anything.
-- Run inside the body's transaction, whose BEGIN IMMEDIATE took the database's write lock: nothing
-- can change the row before the commit. A delivery from another queue than the row's is not
-- claimable here (claim_key.sql says why).
-- Parameters: key, token, task_id, retries, queue.
-- Returns: outcome_id, attempts, claimable (1 or 0), claimed_token; no row when the key has none.
SELECT id AS outcome_id, attempts,
    CASE WHEN (
--- @include "claim_rule"
    ) AND (%(queue)s = '' OR queue = %(queue)s) THEN 1 ELSE 0 END AS claimable,
--- @include "claimed_token"
    AS claimed_token
FROM "queueapp_taskoutcome"
WHERE idempotency_key = %(key)s
