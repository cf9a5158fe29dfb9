-- move_queue: the queue a key's message is delivered from now, when it moved (sqlite/claim_key.sql
-- does not assign it).
-- Parameters: outcome_id, queue.
UPDATE "queueapp_taskoutcome" SET queue = %(queue)s WHERE id = %(outcome_id)s
