-- 0028: books lost with a failover whose workers died too, settled by the reconciler from the result backend.

-- keyed_books_settle_from_result: the books of a task lost with a failover whose worker died too, settled by the
-- reconciler from the task's result in the result backend (its only trace): SUCCESS completed, FAILURE failed, or the
-- never-ran outcome whose Keyed… failure the ledger had stored (rejected, expired, …). Guarded as keyed_books_settle:
-- the task's row locked, nothing written while an attempt of it (this one or a later) is claimed or waiting, and the
-- outcome inserted only where the task has none. True: recorded by this call.
CREATE FUNCTION keyed_books_settle_from_result(p_task_id text, p_attempt integer, p_task_name text, p_key text,
                                               p_outcome text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF p_outcome NOT IN ('completed', 'failed', 'dead_lettered', 'expired', 'rejected', 'superseded', 'revoked',
                         'lost') THEN
        RETURN false;
    END IF;
    PERFORM 1 FROM keyed_tasks WHERE task_id = p_task_id FOR UPDATE;
    IF EXISTS (SELECT 1 FROM keyed_claims WHERE task_id = p_task_id AND attempt >= p_attempt)
       OR EXISTS (SELECT 1 FROM keyed_waiting WHERE task_id = p_task_id AND attempt >= p_attempt) THEN
        RETURN false;
    END IF;
    INSERT INTO keyed_tasks AS t (task_id, task_name, key, arrived_at, outcome, finished_attempt, finished_at,
                                  detail, notified)
    VALUES (p_task_id, p_task_name, p_key, now(), p_outcome, p_attempt, now(),
            'settled from its result after a failover of the ledger', true)
    ON CONFLICT (task_id) DO UPDATE
       SET outcome = EXCLUDED.outcome, finished_attempt = EXCLUDED.finished_attempt,
           finished_at = EXCLUDED.finished_at, detail = EXCLUDED.detail, notified = true, message = NULL
     WHERE t.outcome IS NULL;
    RETURN FOUND;
END
$$;
