-- key_state: where a claimed key stands now, to say why its claim may not commit.
-- Parameters: outcome_id.
-- Returns: status, fence_token; no row when the row was deleted.
SELECT status, fence_token FROM "queueapp_taskoutcome" WHERE id = %(outcome_id)s
