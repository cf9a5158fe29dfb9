-- refuse: a claimed delivery whose success the row no longer allowed (nothing of it committed):
-- its log row gets the verdict, and the row counts it, as a suppressed duplicate or a stale refusal.
-- Parameters: outcome_id, log_id, verdict, detail, suppressed (0 or 1), stale (0 or 1), now.
UPDATE "queueapp_taskdelivery" SET verdict = %(verdict)s, detail = %(detail)s, finished_at = %(now)s
WHERE id = %(log_id)s;

UPDATE "queueapp_taskoutcome" SET suppressed_duplicates = suppressed_duplicates + %(suppressed)s,
    stale_refusals = stale_refusals + %(stale)s, updated_at = %(now)s
WHERE id = %(outcome_id)s
