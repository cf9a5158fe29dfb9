-- check_claim: whether the claim rule lets a delivery claim its key, without writing anything.
-- For a key claim written with the success: run on its own before the body's transaction (it is
-- the connection's health check), and decided again by claim_key_and_succeed under the row lock.
-- Parameters: key, token, task_id, retries.
-- Returns: outcome_id, attempts, claimable (1 or 0), claimed_token; no row when the key has none.
SELECT id AS outcome_id, attempts,
    CASE WHEN (
--- @include "claim_rule"
    ) THEN 1 ELSE 0 END AS claimable,
--- @include "claimed_token"
    AS claimed_token
FROM "queueapp_taskoutcome"
WHERE idempotency_key = %(key)s
