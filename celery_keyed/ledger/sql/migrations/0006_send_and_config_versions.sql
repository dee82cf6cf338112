-- 0006 (issue 14 items 3 and 7): refusal at send (a reservation per task accepted at send, with its dedupe key;
-- refusals counted per name) and versioned name configuration (a worker with older configuration never
-- overwrites what a newer one stored; each holder records the version it runs).

-- Sent: one row per task accepted at send (keyed_admit_at_send) until reconcile drops it (its task has a final
-- outcome, or it never arrived before expires_at). key: the task's first concurrency key, whose waiting
-- room the send was counted in; dedupe_key: at most one live task per dedupe key (live = no final outcome in the
-- books, and arrived or sent within the arrival timeout). Both rules are decided by keyed_admit_at_send under
-- locks (an advisory lock per dedupe key, then the key's keyed_keys row), never by reading in Python.
CREATE TABLE keyed_sent (
    task_id text PRIMARY KEY,
    key text NOT NULL,
    dedupe_key text,
    sent_at timestamptz NOT NULL,
    -- until when a send that has not arrived holds its place (sent_at + the producer's keyed_send_arrival_timeout)
    expires_at timestamptz NOT NULL
);
CREATE INDEX keyed_sent_key_idx ON keyed_sent (key);
CREATE INDEX keyed_sent_dedupe_idx ON keyed_sent (dedupe_key) WHERE dedupe_key IS NOT NULL;

-- Send refusals: how many sends of a name keyed_admit_at_send refused, by reason (room_full, duplicate). A refused
-- send publishes nothing and books nothing in keyed_tasks (the task id never arrived); this is its only record.
CREATE TABLE keyed_send_refusals (
    name text NOT NULL,
    reason text NOT NULL,
    refused bigint NOT NULL DEFAULT 0,
    last_at timestamptz NOT NULL,
    PRIMARY KEY (name, reason),
    CONSTRAINT keyed_send_refusals_reason_known CHECK (reason IN ('room_full', 'duplicate'))
);

-- Configuration versions (keyed_config_version): the version of the settings that stored each name; a worker's
-- upsert is guarded by config_version <= its own (names.NAMES_UPSERT). Each holder records the version it runs.
ALTER TABLE keyed_names ADD COLUMN config_version integer NOT NULL DEFAULT 0;
ALTER TABLE keyed_holders ADD COLUMN config_version integer;

-- keyed_admit_at_send: the producer's one round trip before publishing a keyed task with keyed_admit_at_send.
-- verdict: 'accepted' (a keyed_sent row now holds the task's place; detail 'known' when the task id already had one,
-- or is an open task in the books: a retry or a re-send), 'duplicate' (holder_task_id: the live task with the same
-- dedupe key), 'room_full' (waiting + accepted-not-yet-parked >= max_waiting of the name, overflow 'reject').
-- The room of a key at send = keyed_keys.waiting (parked attempts) + its reservations whose task is neither parked,
-- running nor finished (sent and not arrived before its expires_at, or between attempts); p_arrival_timeout sets the new
-- row's expires_at. Park and claim
-- move a task out of "pending" in the same transaction that puts it in waiting or in a claim, so nothing is
-- counted twice or missed by a snapshot.
-- Locks: an advisory transaction lock per dedupe key (only senders take it), then the key's keyed_keys row (lock
-- order 3; a sender takes no task row and no slot row). Each check is a later statement than the lock it needs
-- (READ COMMITTED: a new snapshot that sees every sender that held the lock before). A refusal counts itself in
-- keyed_send_refusals and leaves no keyed_sent row.
CREATE FUNCTION keyed_admit_at_send(
    p_task_id text, p_key text, p_name text, p_dedupe_key text, p_arrival_timeout double precision,
    p_now timestamptz)
RETURNS TABLE (verdict text, detail text, holder_task_id text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := COALESCE(p_now, now());
    v_other text;
    v_room integer;
    v_overflow text;
    v_waiting integer;
    v_pending integer;
BEGIN
    -- The task's own place: a retry or a re-send of the same task id is accepted again, reserving nothing more.
    IF EXISTS (SELECT 1 FROM keyed_sent s WHERE s.task_id = p_task_id)
       OR EXISTS (SELECT 1 FROM keyed_tasks t WHERE t.task_id = p_task_id AND t.outcome IS NULL) THEN
        RETURN QUERY SELECT 'accepted'::text, 'known'::text, NULL::text;
        RETURN;
    END IF;
    -- Dedupe (one live task per dedupe key): senders of one dedupe key decide one after the other.
    IF p_dedupe_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('keyed_sent:' || p_dedupe_key, 0));
        SELECT s.task_id INTO v_other FROM keyed_sent s LEFT JOIN keyed_tasks t ON t.task_id = s.task_id
         WHERE s.dedupe_key = p_dedupe_key AND t.outcome IS NULL AND (t.task_id IS NOT NULL OR s.expires_at > v_now)
         ORDER BY s.sent_at LIMIT 1;
        IF v_other IS NOT NULL THEN
            INSERT INTO keyed_send_refusals AS r (name, reason, refused, last_at) VALUES (p_name, 'duplicate', 1, v_now)
            ON CONFLICT (name, reason) DO UPDATE SET refused = r.refused + 1, last_at = excluded.last_at;
            RETURN QUERY SELECT 'duplicate'::text, ('dedupe key ' || p_dedupe_key || ' is live in task ' || v_other),
                                v_other;
            RETURN;
        END IF;
    END IF;
    -- The waiting room (max_waiting under overflow 'reject'; an unbounded room or 'supersede' never refuses here).
    SELECT c.max_waiting, c.overflow INTO v_room, v_overflow FROM keyed_names c WHERE c.name = p_name;
    IF v_room IS NOT NULL AND v_overflow = 'reject' THEN
        -- The key's head row, created if missing, locked: parks and promotions of the key change waiting under it.
        INSERT INTO keyed_keys (key, name, waiting, active_at) VALUES (p_key, p_name, 0, v_now)
        ON CONFLICT (key) DO UPDATE SET active_at = excluded.active_at;
        SELECT k.waiting INTO v_waiting FROM keyed_keys k WHERE k.key = p_key;
        SELECT count(*) INTO v_pending FROM keyed_sent s LEFT JOIN keyed_tasks t ON t.task_id = s.task_id
         WHERE s.key = p_key AND t.outcome IS NULL AND (t.task_id IS NOT NULL OR s.expires_at > v_now)
           AND NOT EXISTS (SELECT 1 FROM keyed_waiting w WHERE w.task_id = s.task_id)
           AND NOT EXISTS (SELECT 1 FROM keyed_claims c WHERE c.task_id = s.task_id);
        IF v_waiting + v_pending >= v_room THEN
            INSERT INTO keyed_send_refusals AS r (name, reason, refused, last_at) VALUES (p_name, 'room_full', 1, v_now)
            ON CONFLICT (name, reason) DO UPDATE SET refused = r.refused + 1, last_at = excluded.last_at;
            RETURN QUERY SELECT 'room_full'::text,
                                ('waiting room of ' || p_key || ' is full (' || v_waiting || ' waiting, ' || v_pending
                                 || ' sent, max_waiting ' || v_room || ')'),
                                NULL::text;
            RETURN;
        END IF;
    END IF;
    INSERT INTO keyed_sent (task_id, key, dedupe_key, sent_at, expires_at)
    VALUES (p_task_id, p_key, p_dedupe_key, v_now, v_now + make_interval(secs => p_arrival_timeout));
    RETURN QUERY SELECT 'accepted'::text, ''::text, NULL::text;
END
$$;
