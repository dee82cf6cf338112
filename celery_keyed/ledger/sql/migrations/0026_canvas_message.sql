-- celery-keyed ledger migration 0026: a parked task that gets a never-ran outcome (expired, superseded, debounced
-- away, revoked while waiting) keeps its stored message in the books until its failure result is stored, so the
-- result is stored with the task's canvas context (its chord, the rest of its chain, its errbacks) and a chord or a
-- chain it belongs to completes instead of waiting for ever. Cleared when the result is stored (notified).

ALTER TABLE keyed_tasks ADD COLUMN message jsonb;
ALTER TABLE keyed_tasks ADD CONSTRAINT keyed_tasks_message_until_notified CHECK (message IS NULL OR NOT notified);
