-- 0025: a failover is an outage, named. The ledger remembers the identity of the server that last wrote it (system
-- identifier, timeline, postmaster start). A server whose identity differs (a standby promoted: a new timeline; a
-- restart: a new postmaster start) may have lost the previous server's last commits, among them claims of bodies
-- that still run: until every claim the previous server may have granted has lapsed (one lease from the change's
-- detection, hold_until) no claim is inserted except the re-assertion of a running attempt's own claim.
-- one_row: the ledger has one identity (the row is written by keyed_ledger_identity_check, never by hand)
CREATE TABLE keyed_ledger_identity (
    one_row boolean PRIMARY KEY DEFAULT true,
    system_identifier bigint NOT NULL,
    timeline integer NOT NULL,
    postmaster_start timestamptz NOT NULL,
    seen_at timestamptz NOT NULL,
    hold_until timestamptz,
    CONSTRAINT keyed_ledger_identity_one_row CHECK (one_row)
);

ALTER TABLE keyed_events DROP CONSTRAINT keyed_events_kind_known;
ALTER TABLE keyed_events ADD CONSTRAINT keyed_events_kind_known
    CHECK (kind IN ('drift', 'forced_release', 'reclaimed', 'duplicate', 'retry_missing', 'failover', 'reasserted'));

-- keyed_ledger_timeline: the timeline this server writes on (a primary's WAL insert timeline; a standby's last
-- checkpoint's). Read from memory, no file: cheap enough for every claim insert.
CREATE FUNCTION keyed_ledger_timeline() RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF pg_is_in_recovery() THEN
        RETURN (SELECT timeline_id FROM pg_control_checkpoint());
    END IF;
    RETURN ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::integer;
END
$$;

-- keyed_ledger_identity_check: a client's first contact with a server (each new connection, each heartbeat, each
-- reconcile). Compares the server's identity with the one remembered; a change is recorded (the new identity, a
-- 'failover' event) and holds new starts until now + p_lease (the longest lease asked for wins). kind: NULL (same
-- server, or the first contact ever), 'promoted' (new timeline), 'replaced' (another system identifier) or
-- 'restarted' (new postmaster start only). A standby answers and writes nothing. Concurrent first contacts: the
-- UPDATE's guard makes exactly one of them the detector; the others read the recorded hold.
CREATE FUNCTION keyed_ledger_identity_check(p_lease double precision, OUT kind text, OUT previous text,
                                            OUT current_identity text, OUT hold_until timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_sys bigint := (SELECT c.system_identifier FROM pg_control_system() c);
    v_tli integer := keyed_ledger_timeline();
    v_start timestamptz := pg_postmaster_start_time();
    r keyed_ledger_identity;
BEGIN
    current_identity := format('system %s, timeline %s, started %s', v_sys, v_tli, v_start);
    IF pg_is_in_recovery() THEN
        RETURN;
    END IF;
    SELECT * INTO r FROM keyed_ledger_identity;
    IF NOT FOUND THEN
        INSERT INTO keyed_ledger_identity (system_identifier, timeline, postmaster_start, seen_at)
        VALUES (v_sys, v_tli, v_start, now()) ON CONFLICT DO NOTHING;
        RETURN;
    END IF;
    IF (r.system_identifier, r.timeline, r.postmaster_start) = (v_sys, v_tli, v_start) THEN
        hold_until := r.hold_until;
        RETURN;
    END IF;
    -- A restart of the same server (same system, same timeline) lost nothing: every ledger transaction whose
    -- outcome matters commits with synchronous_commit on (durable before it returns), so no claim it granted is
    -- gone and nothing is held; only a new timeline or another system may have lost the last commits.
    UPDATE keyed_ledger_identity i
       SET system_identifier = v_sys, timeline = v_tli, postmaster_start = v_start, seen_at = now(),
           hold_until = CASE WHEN (i.system_identifier, i.timeline) = (v_sys, v_tli) THEN i.hold_until
                             ELSE GREATEST(i.hold_until, now() + make_interval(secs => p_lease)) END
     WHERE (i.system_identifier, i.timeline, i.postmaster_start) IS DISTINCT FROM (v_sys, v_tli, v_start)
    RETURNING i.hold_until INTO hold_until;
    IF NOT FOUND THEN  -- another first contact recorded it meanwhile
        SELECT i.hold_until INTO hold_until FROM keyed_ledger_identity i;
        RETURN;
    END IF;
    kind := CASE WHEN r.system_identifier <> v_sys THEN 'replaced'
                 WHEN r.timeline <> v_tli THEN 'promoted'
                 ELSE 'restarted' END;
    IF kind = 'restarted' THEN
        RETURN;
    END IF;
    previous := format('system %s, timeline %s, started %s', r.system_identifier, r.timeline, r.postmaster_start);
    INSERT INTO keyed_events (kind, detail, at)
    VALUES ('failover', format('%s: %s -> %s; no new start until %s', kind, previous, current_identity, hold_until),
            now());
END
$$;

-- keyed_failover_holding: whether new starts wait (a recorded hold not over, or a server whose identity nobody has
-- checked yet). The reaper waits too: a running attempt re-asserts or renews its claim on the new server first.
-- (PL/pgSQL: its statement's plan is kept for the session; as a SQL function it was planned at every claim.)
CREATE FUNCTION keyed_failover_holding() RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM keyed_ledger_identity i
                    WHERE i.hold_until > now() OR i.timeline <> keyed_ledger_timeline()
                       OR i.system_identifier <> (SELECT c.system_identifier FROM pg_control_system() c));
END
$$;

-- keyed_claims_failover_guard: no claim is inserted while keyed_failover_holding(), except by
-- keyed_claims_reassert (a body that runs takes its own claim back). The error is the server's "cannot connect now"
-- (57P03): to a worker the ledger is unavailable for a moment; it holds the task and tries again.
CREATE FUNCTION keyed_claims_failover_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('keyed.reassert', true) = 'on' OR NOT keyed_failover_holding() THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'celery-keyed: after a failover of the ledger no new start until the previous server''s claims have lapsed'
        USING ERRCODE = '57P03';
END
$$;
CREATE TRIGGER keyed_claims_failover_guard BEFORE INSERT ON keyed_claims
    FOR EACH ROW EXECUTE FUNCTION keyed_claims_failover_guard();

-- keyed_claims_reassert: a worker whose running attempt's claim is missing (lost with the previous server's last
-- commits) takes it back, with the same fence, under the slot guard (used + cost <= share, as any claim): 'kept'
-- (the claim is there with this fence: renewed), 'reasserted', or 'refused' (the slot was taken meanwhile, another
-- claim of the attempt exists, the task has an outcome, or the claim held more than one key's slots: the worker
-- stops the body, which runs again). The task's row is recorded if it was lost too, so its outcome has books.
CREATE FUNCTION keyed_claims_reassert(p_task_id text, p_attempt integer, p_fence bigint, p_holder text, p_key text,
                                      p_shard integer, p_name text, p_cost integer, p_task_name text,
                                      p_lease double precision) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_fence bigint;
    v_shard integer;
    v_try integer;
BEGIN
    PERFORM 1 FROM keyed_tasks WHERE task_id = p_task_id FOR UPDATE;
    SELECT c.fence INTO v_fence FROM keyed_claims c WHERE c.task_id = p_task_id AND c.attempt = p_attempt FOR UPDATE;
    IF FOUND THEN
        IF v_fence <> p_fence THEN
            RETURN 'refused';
        END IF;
        UPDATE keyed_claims SET state = 'running', holder = p_holder, nonce = NULL, dispatch_deadline = NULL,
               lease_expires_at = now() + make_interval(secs => p_lease)
         WHERE task_id = p_task_id AND attempt = p_attempt AND state IN ('running', 'promoted');
        RETURN CASE WHEN FOUND THEN 'kept' ELSE 'refused' END;
    END IF;
    IF p_key IS NULL OR EXISTS (SELECT 1 FROM keyed_tasks WHERE task_id = p_task_id AND outcome IS NOT NULL) THEN
        RETURN 'refused';
    END IF;
    INSERT INTO keyed_slots (key, shard, name, used)
    SELECT p_key, g, p_name, 0 FROM generate_series(0, keyed_name_shards(p_name) - 1) AS g
    ON CONFLICT (key, shard) DO NOTHING;
    -- the claim's own shard, or (p_shard NULL: not known) the first shard where it fits; each take is guarded
    v_shard := NULL;
    FOR v_try IN SELECT g FROM generate_series(0, keyed_name_shards(p_name) - 1) AS g
                  WHERE p_shard IS NULL OR g = p_shard LOOP
        UPDATE keyed_slots s SET used = s.used + p_cost
         WHERE s.key = p_key AND s.shard = v_try
           AND s.used + p_cost <= keyed_row_share(p_key, now(), s.shards, keyed_name_shards(s.name), s.shard)
        RETURNING s.shard INTO v_shard;
        EXIT WHEN v_shard IS NOT NULL;
    END LOOP;
    IF v_shard IS NULL THEN
        RETURN 'refused';
    END IF;
    INSERT INTO keyed_tasks (task_id, task_name, key, arrived_at) VALUES (p_task_id, p_task_name, p_key, now())
    ON CONFLICT (task_id) DO NOTHING;
    PERFORM set_config('keyed.reassert', 'on', true);
    INSERT INTO keyed_claims (task_id, attempt, key, shard, state, fence, holder, lease_expires_at, claimed_at, cost)
    VALUES (p_task_id, p_attempt, p_key, v_shard, 'running', p_fence, p_holder,
            now() + make_interval(secs => p_lease), now(), p_cost);
    PERFORM set_config('keyed.reassert', 'off', true);
    PERFORM setval('keyed_fence_seq', GREATEST(p_fence, (SELECT last_value FROM keyed_fence_seq)));
    INSERT INTO keyed_events (kind, key, task_id, detail, at)
    VALUES ('reasserted', p_key, p_task_id, format('attempt %s, fence %s, holder %s', p_attempt, p_fence, p_holder),
            now());
    RETURN 'reasserted';
END
$$;

-- keyed_books_settle: the books of an attempt that ended with a final outcome on the previous server, of which this
-- one has neither the outcome nor a claim (the arrival and the release were both lost): its outcome is recorded from
-- what the worker that ran it remembers (its result is stored in the result backend already: notified). Nothing is
-- written when the task has an outcome, or a claim or waiting row of this attempt or a later one. True: recorded.
CREATE FUNCTION keyed_books_settle(p_task_id text, p_attempt integer, p_task_name text, p_key text, p_outcome text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF p_outcome NOT IN ('completed', 'failed') THEN
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
            'settled after a failover of the ledger', true)
    ON CONFLICT (task_id) DO UPDATE
       SET outcome = EXCLUDED.outcome, finished_attempt = EXCLUDED.finished_attempt,
           finished_at = EXCLUDED.finished_at, detail = EXCLUDED.detail, notified = true
     WHERE t.outcome IS NULL;
    RETURN FOUND;
END
$$;

-- keyed_failover_reaper_waits: the reaper waits one more lease after a hold (two from the failover's detection): the
-- claims the previous server had, whose releases were lost with it, are released again by their workers meanwhile
-- (the promotions those releases make wait for the hold's end) instead of being reclaimed as expired.
CREATE FUNCTION keyed_failover_reaper_waits() RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN keyed_failover_holding()
        OR EXISTS (SELECT 1 FROM keyed_ledger_identity i WHERE i.hold_until + (i.hold_until - i.seen_at) > now());
END
$$;
