-- 0023: a retry is a publish like any other. A retry's message can be lost between the worker that published it and
-- the next one (a worker killed after taking it off the broker's list, before the broker counted it as unacked):
-- the task would stay between attempts for ever. A keyed retry is registered in keyed_outbox when it is published,
-- keyed by the attempt it starts: attempt = n for retry number n (0, the default, for a task's first publish). With
-- the outbox on for the task, the row keeps a copy of the message and the relay publishes it again when attempt n
-- has not arrived by its due time; without it the row keeps no copy (message NULL): the relay skips it, and
-- reconcile reports it once it is overdue (reported: it was; kind 'retry_missing' in keyed_events).
ALTER TABLE keyed_outbox ADD COLUMN attempt integer NOT NULL DEFAULT 0;
ALTER TABLE keyed_outbox ADD COLUMN reported boolean NOT NULL DEFAULT false;
ALTER TABLE keyed_outbox ALTER COLUMN message DROP NOT NULL;
ALTER TABLE keyed_outbox ADD CONSTRAINT keyed_outbox_attempt_nonnegative CHECK (attempt >= 0);
-- only a retry's row may go without a copy (a first publish is registered only to be delivered)
ALTER TABLE keyed_outbox ADD CONSTRAINT keyed_outbox_copy_unless_retry CHECK (message IS NOT NULL OR attempt > 0);

ALTER TABLE keyed_events DROP CONSTRAINT keyed_events_kind_known;
ALTER TABLE keyed_events ADD CONSTRAINT keyed_events_kind_known
    CHECK (kind IN ('drift', 'forced_release', 'reclaimed', 'duplicate', 'retry_missing'));

-- keyed_outbox_attempt_arrived: a retry's row goes in the statement that records the arrival of its attempt (or of
-- a later one): every admitted attempt inserts a claim or a waiting row. Only for attempts after the first (the
-- WHEN clauses: a first arrival is keyed_tasks_outbox_received's, and costs nothing more here). An arrival that
-- ends the task without a claim or a waiting row (expired, revoked) leaves the row to the relay and reconcile,
-- which drop it (outbox.OUTBOX_RETRY_OVER).
CREATE FUNCTION keyed_outbox_attempt_arrived() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM keyed_outbox o WHERE o.task_id = NEW.task_id AND o.attempt > 0 AND o.attempt <= NEW.attempt;
    RETURN NULL;
END
$$;
CREATE TRIGGER keyed_claims_outbox_arrived AFTER INSERT ON keyed_claims
    FOR EACH ROW WHEN (NEW.attempt > 0) EXECUTE FUNCTION keyed_outbox_attempt_arrived();
CREATE TRIGGER keyed_waiting_outbox_arrived AFTER INSERT ON keyed_waiting
    FOR EACH ROW WHEN (NEW.attempt > 0) EXECUTE FUNCTION keyed_outbox_attempt_arrived();
