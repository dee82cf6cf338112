-- 0008 (issue 14 item 8): a transactional outbox. With keyed_register_at_publish a producer stores each keyed
-- message in the ledger when it publishes it (in the caller's transaction when one is given); a message no worker
-- received within the arrival timeout is published again from the stored copy; a task's row goes in the statement
-- that records its arrival.

-- Outbox: one row per task registered at publish and not received by a worker yet. message: the broker message
-- as the ledger stores a parked one (messages.record_published: body base64, content type and encoding, headers,
-- properties, exchange, routing key). due_at: when the relay publishes it (again): the registration time for a
-- registration made in the caller's transaction (pending: not published yet, the relay's first publish is not a
-- republish), else the expected arrival (the later of now and its ETA) + the arrival timeout. republished: how
-- many times the relay published it again from this copy (a duplicate of a received copy is dropped by D8).
CREATE TABLE keyed_outbox (
    task_id text PRIMARY KEY,
    task_name text NOT NULL DEFAULT '',
    key text,
    group_key text,
    message jsonb NOT NULL,
    registered_at timestamptz NOT NULL,
    due_at timestamptz NOT NULL,
    pending boolean NOT NULL DEFAULT false,
    republished integer NOT NULL DEFAULT 0,
    republished_at timestamptz,
    -- the relay's count only grows from zero (a negative count is a bug, not a state)
    CONSTRAINT keyed_outbox_republished_nonnegative CHECK (republished >= 0)
);
-- The relay takes the rows that are due, oldest first, without reading the rest.
CREATE INDEX keyed_outbox_due_idx ON keyed_outbox (due_at);

-- keyed_outbox_received: a task registered at publish is never republished after its arrival is recorded. Every
-- arrival (the fast claims, keyed_claim_many, keyed_admit_plain, the general admission, a rejection of unreadable
-- keys, a revoke before arrival, a group number recorded lost) inserts the task's keyed_tasks row; this trigger
-- deletes its outbox row in that same statement, so "received" and "still to deliver" never coexist. A task id that
-- arrived earlier is never registered (outbox.OUTBOX_REGISTER), and the relay drops a row whose task it finds in
-- the books (a registration that raced a revoke).
CREATE FUNCTION keyed_outbox_received() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM keyed_outbox o WHERE o.task_id = NEW.task_id;
    RETURN NULL;
END
$$;
CREATE TRIGGER keyed_tasks_outbox_received AFTER INSERT ON keyed_tasks
    FOR EACH ROW EXECUTE FUNCTION keyed_outbox_received();
