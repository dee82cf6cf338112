-- 0009: park at receipt (issue 13). The worker parks an arrival of a key with a line as soon as it receives it,
-- without waiting for a pool process (which only attempts that will run should take): keyed_admit_plain becomes
-- keyed_admit_or_park_plain with p_park_only, and keyed_admit_plain a wrapper of it (one body for both).

-- keyed_admit_or_park_plain: admit-or-park of one plain arrival — one key, no group, no not-before, cost 1, no
-- supersede key, on a name without a rate — in one call (the general path's transaction, admit.admit, for that
-- case). Answers one row: verdict 'admitted' (fence, shard), 'parked', 'rejected' (its waiting room is full under
-- the policy 'reject'; the outcome is recorded) or 'general' when the general path must decide (a known attempt
-- token (D8), a task past its latest start, room next to a promotable waiter, a full room under 'supersede', a
-- group member); 'general' is answered before anything but the task's arrival was written.
-- p_park_only (the worker's park at receipt, docs/worker.md): the arrival is parked when its key has a line or no
-- room, exactly as above; where it would be admitted it is answered 'undecided' instead (no slot is ever taken:
-- D3, a slot is claimed only when a pool process can start the attempt).
-- Locks, in lock order: the task row; every slot row of the key in shard order (unconditionally, D2: a release
-- that gives a slot back either committed before — its room is seen — or sees this park); the key's head row.
CREATE FUNCTION keyed_admit_or_park_plain(
    p_task_id text, p_attempt integer, p_task_name text, p_key text, p_priority integer, p_deadline timestamptz,
    p_queue text, p_message jsonb, p_fair_key text, p_holder text, p_lease double precision, p_now timestamptz,
    p_park_only boolean)
RETURNS TABLE (verdict text, new boolean, fence bigint, shard integer, detail text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := COALESCE(p_now, now());
    v_name text := split_part(p_key, ':', 1);
    v_new boolean;
    v_outcome text;
    v_finished integer;
    v_shards integer := keyed_name_shards(split_part(p_key, ':', 1));
    v_limit integer;
    v_locked integer;
    v_room integer;
    v_fence bigint;
    v_policy text;
BEGIN
    IF EXISTS (SELECT 1 FROM keyed_names c WHERE c.name = v_name AND c.rate IS NOT NULL) THEN
        RETURN QUERY SELECT 'general'::text, NULL::boolean, NULL::bigint, NULL::integer, ''::text;
        RETURN;
    END IF;
    IF p_park_only AND NOT EXISTS (
           SELECT 1 FROM keyed_waiting w
            WHERE w.key = p_key AND NOT w.shadow AND (w.not_before IS NULL OR w.not_before <= v_now)
              AND NOT w.group_blocked AND (w.deadline IS NULL OR w.deadline > v_now))
       AND (EXISTS (
                SELECT 1 FROM keyed_slots s
                 WHERE s.key = p_key
                   AND s.used + 1 <= keyed_shard_share(keyed_effective_limit(v_name, v_now), v_shards, s.shard))
            OR NOT EXISTS (SELECT 1 FROM keyed_slots s WHERE s.key = p_key)) THEN
        -- Park only (at receipt): no line and room (or a key's first use), so the arrival is left to its admission when a pool process
        -- is ready for it (D3), and nothing is written. Read without locks: a wrong guess either way is harmless —
        -- a line that formed meanwhile is decided under the locks below (parked), a line that drained meanwhile is
        -- answered 'undecided' there too; a slot is never taken here.
        RETURN QUERY SELECT 'undecided'::text, NULL::boolean, NULL::bigint, NULL::integer, ''::text;
        RETURN;
    END IF;
    -- The books: record the arrival, or lock the task's row (two deliveries are admitted one after the other, D8).
    INSERT INTO keyed_tasks AS kt (task_id, task_name, key, group_key, arrived_at)
    VALUES (p_task_id, p_task_name, p_key, NULL, v_now)
    ON CONFLICT (task_id) DO UPDATE SET task_id = excluded.task_id
    RETURNING (kt.xmax = 0), kt.outcome, kt.finished_attempt INTO v_new, v_outcome, v_finished;
    IF NOT v_new AND (v_outcome IS NOT NULL OR v_finished >= p_attempt
                      OR EXISTS (SELECT 1 FROM keyed_claims k WHERE k.task_id = p_task_id AND k.attempt = p_attempt)
                      OR EXISTS (SELECT 1 FROM keyed_waiting w WHERE w.task_id = p_task_id AND w.attempt = p_attempt))
       OR p_deadline <= v_now
       OR EXISTS (SELECT 1 FROM keyed_group_members m WHERE m.task_id = p_task_id) THEN
        RETURN QUERY SELECT 'general'::text, v_new, NULL::bigint, NULL::integer, ''::text;
        RETURN;
    END IF;
    -- Every shard row of the key, created on first use, locked in shard order.
    SELECT count(*) INTO v_locked FROM (
        SELECT 1 FROM keyed_slots s WHERE s.key = p_key ORDER BY s.shard FOR UPDATE) l;
    IF v_locked < v_shards THEN
        INSERT INTO keyed_slots (key, shard, name, used)
        SELECT p_key, g, v_name, 0 FROM generate_series(0, v_shards - 1) AS g
        ON CONFLICT (key, shard) DO NOTHING;
        PERFORM 1 FROM keyed_slots s WHERE s.key = p_key ORDER BY s.shard FOR UPDATE;
    END IF;
    INSERT INTO keyed_keys (key, name, waiting, active_at) VALUES (p_key, v_name, 0, v_now)
    ON CONFLICT (key) DO UPDATE SET active_at = excluded.active_at;
    v_limit := keyed_effective_limit(v_name, v_now);
    SELECT s.shard INTO v_room FROM keyed_slots s
     WHERE s.key = p_key AND s.used + 1 <= keyed_shard_share(v_limit, v_shards, s.shard)
     ORDER BY s.shard LIMIT 1;
    IF EXISTS (SELECT 1 FROM keyed_waiting w
                WHERE w.key = p_key AND NOT w.shadow AND (w.not_before IS NULL OR w.not_before <= v_now)
                  AND NOT w.group_blocked AND (w.deadline IS NULL OR w.deadline > v_now)) THEN
        IF v_room IS NOT NULL THEN
            -- Room with a line in front of it: the general path starts the line's head first (admit.admit).
            RETURN QUERY SELECT 'general'::text, v_new, NULL::bigint, NULL::integer, ''::text;
            RETURN;
        END IF;
    ELSIF v_room IS NOT NULL AND p_park_only THEN
        -- Park only: room and no line under the locks; the arrival is admitted later, when a pool process is
        -- ready (D3). Its arrival is recorded (a later admission sees a known task with no claim and no waiting
        -- row: the ordinary path).
        RETURN QUERY SELECT 'undecided'::text, v_new, NULL::bigint, NULL::integer, ''::text;
        RETURN;
    ELSIF v_room IS NOT NULL THEN
        -- The bound (D1): the guarded take under the row's lock.
        UPDATE keyed_slots s SET used = s.used + 1
         WHERE s.key = p_key AND s.shard = v_room AND s.used + 1 <= keyed_shard_share(v_limit, v_shards, s.shard)
        RETURNING s.shard INTO v_room;
        IF v_room IS NOT NULL THEN
            INSERT INTO keyed_claims (task_id, attempt, key, shard, group_key, state, fence, holder,
                                      lease_expires_at, claimed_at, cost, fair_key)
            VALUES (p_task_id, p_attempt, p_key, v_room, NULL, 'running', nextval('keyed_fence_seq'), p_holder,
                    v_now + make_interval(secs => p_lease), v_now, 1, p_fair_key)
            RETURNING keyed_claims.fence INTO v_fence;
            RETURN QUERY SELECT 'admitted'::text, v_new, v_fence, v_room, ''::text;
            RETURN;
        END IF;
    END IF;
    -- Park: a place in the waiting room (max_waiting, the guarded increment of keys.KEYS_ADD_WAITING).
    UPDATE keyed_keys k SET waiting = k.waiting + 1
     WHERE k.key = p_key
       AND k.waiting < COALESCE((SELECT c.max_waiting FROM keyed_names c WHERE c.name = v_name), 2147483647);
    IF NOT FOUND THEN
        SELECT c.overflow INTO v_policy FROM keyed_names c WHERE c.name = v_name;
        IF v_policy = 'supersede' THEN
            RETURN QUERY SELECT 'general'::text, v_new, NULL::bigint, NULL::integer, ''::text;
            RETURN;
        END IF;
        -- The one final outcome (books.BOOKS_FINISH: outcome IS NULL).
        UPDATE keyed_tasks t SET outcome = 'rejected', finished_at = v_now,
               detail = 'waiting room of ' || p_key || ' is full', finished_attempt = GREATEST(t.finished_attempt, p_attempt)
         WHERE t.task_id = p_task_id AND t.outcome IS NULL;
        RETURN QUERY SELECT 'rejected'::text, v_new, NULL::bigint, NULL::integer,
                            'waiting room of ' || p_key || ' is full';
        RETURN;
    END IF;
    -- The parked row (waiting.WAITING_INSERT): latest start = the earlier of expires and arrival + max_wait.
    INSERT INTO keyed_waiting (task_id, attempt, key, group_key, group_seq, priority, arrival, arrived_at, not_before,
                               deadline, supersede_key, shadow, group_blocked, queue, message, keys, cost,
                               reserved_keys, reserved_shards, reserved_at, fair_key)
    VALUES (p_task_id, p_attempt, p_key, NULL, NULL, p_priority, nextval('keyed_arrival_seq'), v_now, NULL,
            LEAST(p_deadline, v_now + (SELECT make_interval(secs => c.max_wait) FROM keyed_names c WHERE c.name = v_name)),
            NULL, false, false, p_queue, p_message, NULL, 1, NULL, NULL, NULL, p_fair_key);
    RETURN QUERY SELECT 'parked'::text, v_new, NULL::bigint, NULL::integer, ''::text;
END
$$;

DROP FUNCTION keyed_admit_plain(text, integer, text, text, integer, timestamptz, text, jsonb, text, text,
                                double precision, timestamptz);

-- keyed_admit_plain: keyed_admit_or_park_plain deciding (admit or park), for the admission of an arrival whose
-- pool process is ready (D3).
CREATE FUNCTION keyed_admit_plain(
    p_task_id text, p_attempt integer, p_task_name text, p_key text, p_priority integer, p_deadline timestamptz,
    p_queue text, p_message jsonb, p_fair_key text, p_holder text, p_lease double precision, p_now timestamptz)
RETURNS TABLE (verdict text, new boolean, fence bigint, shard integer, detail text)
LANGUAGE sql AS $$
    SELECT * FROM keyed_admit_or_park_plain(p_task_id, p_attempt, p_task_name, p_key, p_priority, p_deadline,
                                            p_queue, p_message, p_fair_key, p_holder, p_lease, p_now, false)
$$;
