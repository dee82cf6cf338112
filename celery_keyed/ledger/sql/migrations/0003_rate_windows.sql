-- Rate windows per key: a name's windows [[N, seconds], ...] (at most N starts of a key in any window of that many
-- seconds), beside or instead of its token bucket.

ALTER TABLE keyed_names
    -- rate windows per key: [[N, seconds], ...], at most N starts in any window of that many seconds (keyed_take_rate)
    ADD COLUMN windows jsonb,
    ADD CONSTRAINT keyed_names_windows_array CHECK (windows IS NULL OR jsonb_typeof(windows) = 'array'),
    -- whether a start of a key of this name takes from a rate limit (a token bucket, windows or both)
    ADD COLUMN rated boolean NOT NULL GENERATED ALWAYS AS (rate IS NOT NULL OR windows IS NOT NULL) STORED;

-- Rate windows (keyed_names.windows): per key, the times of its latest starts, as a ring of `ring` rows (the
-- name's largest N) that position `pos` (the key's count of starts so far) overwrites at slot pos % ring; a start
-- of cost c fits every window [N, T] when the start at position next_pos + c - 1 - N is T old (O(1) per window, exact:
-- at most N starts in any T seconds). Taken beside the token bucket under the key's head row lock, all or none
-- (keyed_take_rate). Kept apart from keyed_keys (a daily quota outlives an idle key's row); reconcile deletes a key's
-- rows once its latest start is older than its name's longest window (windows.prune).
CREATE TABLE keyed_windows (
    key text PRIMARY KEY,
    name text NOT NULL,
    next_pos bigint NOT NULL,  -- the position the key's next start takes
    ring integer NOT NULL,  -- the ring's size when last written (a changed one re-slots the rows kept)
    last_at timestamptz NOT NULL,  -- the latest start's time (starts are recorded in order: never before it)
    CONSTRAINT keyed_windows_ring_positive CHECK (ring > 0)
);
CREATE TABLE keyed_window_starts (
    key text NOT NULL REFERENCES keyed_windows (key) ON DELETE CASCADE,
    slot integer NOT NULL,
    pos bigint NOT NULL,
    at timestamptz NOT NULL,
    PRIMARY KEY (key, slot)
);

-- keyed_take_rate: take what a start of cost p_cost needs from a rate-limited key (the caller holds its keyed_keys
-- row locked): tokens of its name's bucket and one position per cost in each of its windows, all or none. unrated:
-- the name has neither; took: taken; else next_at: when every one of them would let it (its bucket's tokens exist,
-- each window's oldest start in the way is a window old), for the attempt's not-before time (D2: no polling).
-- A cost above a window's N never fits (admission rejects it first: names.NAMES_LARGEST_SHARE).
CREATE FUNCTION keyed_take_rate(p_key text, p_name text, p_cost integer, p_now timestamptz,
                                OUT unrated boolean, OUT took boolean, OUT next_at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := COALESCE(p_now, now());
    v_rate double precision;
    v_burst double precision;
    v_windows jsonb;
    v_avail double precision;
    v_ring integer;
    v_next bigint := 0;
    v_last timestamptz;
    v_had_ring integer;
    v_at timestamptz;
    v_free timestamptz;
    v_pos bigint[];
    v_ats timestamptz[];
    w record;
BEGIN
    took := false;
    SELECT c.rate, COALESCE(c.burst, 1), c.windows INTO v_rate, v_burst, v_windows
      FROM keyed_names c WHERE c.name = p_name AND c.rated;
    unrated := NOT FOUND;
    IF unrated THEN
        RETURN;
    END IF;
    next_at := v_now;
    IF v_rate IS NOT NULL THEN
        SELECT LEAST(v_burst, COALESCE(k.tokens, v_burst)
                     + v_rate * GREATEST(EXTRACT(EPOCH FROM v_now - COALESCE(k.tokens_at, v_now)), 0))
          INTO v_avail FROM keyed_keys k WHERE k.key = p_key;
        IF NOT FOUND THEN
            next_at := NULL;
            RETURN;
        END IF;
        IF v_avail < p_cost THEN
            next_at := v_now + make_interval(secs => (p_cost - v_avail) / v_rate);
        END IF;
    END IF;
    IF v_windows IS NOT NULL THEN
        SELECT max((e ->> 0)::integer) INTO v_ring FROM jsonb_array_elements(v_windows) e;
        -- the key's head row, created if need be and locked: two takes of one key never read the same position
        INSERT INTO keyed_windows (key, name, next_pos, ring, last_at) VALUES (p_key, p_name, 0, v_ring, '-infinity')
        ON CONFLICT (key) DO NOTHING;
        SELECT h.next_pos, h.last_at, h.ring INTO v_next, v_last, v_had_ring
          FROM keyed_windows h WHERE h.key = p_key FOR UPDATE;
        IF NOT FOUND THEN  -- pruned meanwhile: every start it kept was older than every window
            v_next := 0;
        ELSIF v_had_ring <> v_ring THEN
            -- the name's windows changed their largest N: keep the latest starts the new ring holds, re-slotted
            SELECT array_agg(s.pos), array_agg(s.at) INTO v_pos, v_ats
              FROM keyed_window_starts s WHERE s.key = p_key AND s.pos >= v_next - v_ring;
            DELETE FROM keyed_window_starts s WHERE s.key = p_key;
            INSERT INTO keyed_window_starts (key, slot, pos, at)
            SELECT p_key, CAST(u.pos % v_ring AS integer), u.pos, u.at FROM unnest(v_pos, v_ats) AS u(pos, at);
            UPDATE keyed_windows h SET ring = v_ring WHERE h.key = p_key;
        END IF;
        FOR w IN SELECT (e ->> 0)::integer AS n, (e ->> 1)::double precision AS secs
                   FROM jsonb_array_elements(v_windows) e LOOP
            IF p_cost > w.n THEN
                next_at := GREATEST(next_at, v_now + make_interval(secs => w.secs));
            ELSIF v_next + p_cost - 1 - w.n >= 0 THEN
                -- starts are recorded in order, so the latest of the starts the take pushes out of the window decides
                SELECT s.at + make_interval(secs => w.secs) INTO v_free FROM keyed_window_starts s
                 WHERE s.key = p_key AND s.slot = (v_next + p_cost - 1 - w.n) % v_ring
                   AND s.pos = v_next + p_cost - 1 - w.n;
                IF FOUND AND v_free > v_now THEN
                    next_at := GREATEST(next_at, v_free);
                END IF;
            END IF;
        END LOOP;
    END IF;
    IF next_at > v_now THEN
        RETURN;
    END IF;
    IF v_rate IS NOT NULL THEN
        UPDATE keyed_keys k SET tokens = v_avail - p_cost, tokens_at = v_now WHERE k.key = p_key;
    END IF;
    IF v_windows IS NOT NULL THEN
        v_at := GREATEST(v_now, v_last);
        INSERT INTO keyed_windows AS h (key, name, next_pos, ring, last_at)
        VALUES (p_key, p_name, v_next + p_cost, v_ring, v_at)
        ON CONFLICT (key) DO UPDATE SET next_pos = excluded.next_pos, ring = excluded.ring, last_at = excluded.last_at;
        INSERT INTO keyed_window_starts AS s (key, slot, pos, at)
        SELECT p_key, CAST((v_next + i) % v_ring AS integer), v_next + i, v_at FROM generate_series(0, p_cost - 1) AS i
        ON CONFLICT (key, slot) DO UPDATE SET pos = excluded.pos, at = excluded.at;
    END IF;
    took := true;
    next_at := NULL;
END
$$;

-- The fast paths leave a name with windows to the general path, as one with a token bucket (rated).

CREATE OR REPLACE FUNCTION keyed_claim_many(
    p_task_ids text[], p_attempts integer[], p_task_names text[], p_keys text[], p_deadlines timestamptz[],
    p_costs integer[], p_fair_keys text[], p_holder text, p_lease double precision, p_now timestamptz)
RETURNS TABLE (ord integer, new boolean, fence bigint, shard integer)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := COALESCE(p_now, now());
    v_new boolean[];
    r record;
    v_key text := NULL;
    v_blocked boolean := false;
    v_shards integer;
    v_rated boolean;
    v_shard integer;
    v_fence bigint;
BEGIN
    -- The books: one row per task id, inserted or locked in task id order; new only for the first position of a
    -- task id in the batch (a second delivery in the same batch is a known task).
    WITH a AS (
        SELECT t.task_id, t.task_name, t.key, t.ord
          FROM unnest(p_task_ids, p_task_names, p_keys) WITH ORDINALITY AS t(task_id, task_name, key, ord)
    ), firsts AS (
        SELECT DISTINCT ON (a.task_id) a.task_id, a.task_name, a.key, a.ord FROM a ORDER BY a.task_id, a.ord
    ), ins AS (
        INSERT INTO keyed_tasks AS kt (task_id, task_name, key, group_key, arrived_at)
        SELECT f.task_id, f.task_name, f.key, NULL, v_now FROM firsts f ORDER BY f.task_id
        ON CONFLICT (task_id) DO UPDATE SET task_id = excluded.task_id
        RETURNING kt.task_id, (kt.xmax = 0) AS new
    )
    SELECT array_agg(COALESCE(ins.new AND f.ord = a.ord, false) ORDER BY a.ord) INTO v_new
      FROM a JOIN firsts f ON f.task_id = a.task_id JOIN ins ON ins.task_id = a.task_id;

    FOR r IN
        SELECT t.key, t.ord::integer AS ord, t.task_id, t.attempt, t.deadline, t.cost, t.fair_key
          FROM unnest(p_keys, p_task_ids, p_attempts, p_deadlines, p_costs, p_fair_keys)
               WITH ORDINALITY AS t(key, task_id, attempt, deadline, cost, fair_key, ord)
         ORDER BY t.key, t.ord
    LOOP
        IF r.key IS DISTINCT FROM v_key THEN
            v_key := r.key;
            v_blocked := false;
            SELECT keyed_name_shards(split_part(r.key, ':', 1)),
                   COALESCE((SELECT c.rated FROM keyed_names c WHERE c.name = split_part(r.key, ':', 1)), false)
              INTO v_shards, v_rated;
        END IF;
        v_shard := NULL;
        v_fence := NULL;
        IF NOT v_blocked AND v_new[r.ord] AND NOT v_rated AND (r.deadline IS NULL OR r.deadline > v_now) THEN
            IF v_shards = 1 THEN
                SELECT s.shard INTO v_shard FROM keyed_slots s
                 WHERE s.key = r.key AND s.used + r.cost <= keyed_row_share(r.key, v_now, s.shards, v_shards, s.shard)
                   AND NOT EXISTS (
                       SELECT 1 FROM keyed_waiting w
                        WHERE w.key = r.key AND NOT w.shadow AND (w.not_before IS NULL OR w.not_before <= v_now)
                          AND NOT w.group_blocked AND (w.deadline IS NULL OR w.deadline > v_now))
                 LIMIT 1
                   FOR UPDATE OF s;
            ELSE
                SELECT s.shard INTO v_shard FROM keyed_slots s
                 WHERE s.key = r.key AND s.used + r.cost <= keyed_row_share(r.key, v_now, s.shards, v_shards, s.shard)
                   AND NOT EXISTS (
                       SELECT 1 FROM keyed_waiting w
                        WHERE w.key = r.key AND NOT w.shadow AND (w.not_before IS NULL OR w.not_before <= v_now)
                          AND NOT w.group_blocked AND (w.deadline IS NULL OR w.deadline > v_now))
                 ORDER BY random() LIMIT 1
                   FOR UPDATE OF s SKIP LOCKED;
            END IF;
            IF v_shard IS NOT NULL THEN
                -- The guard again under the lock: the bound holds even if the limit changed (D1).
                UPDATE keyed_slots s SET used = s.used + r.cost
                 WHERE s.key = r.key AND s.shard = v_shard
                   AND s.used + r.cost <= keyed_row_share(r.key, v_now, s.shards, v_shards, s.shard)
                RETURNING s.shard INTO v_shard;
            END IF;
            IF v_shard IS NOT NULL THEN
                INSERT INTO keyed_claims (task_id, attempt, key, shard, group_key, state, fence, holder,
                                          lease_expires_at, claimed_at, cost, fair_key)
                VALUES (r.task_id, r.attempt, r.key, v_shard, NULL, 'running', nextval('keyed_fence_seq'), p_holder,
                        v_now + make_interval(secs => p_lease), v_now, r.cost, r.fair_key)
                RETURNING keyed_claims.fence INTO v_fence;
            END IF;
        END IF;
        IF v_fence IS NULL THEN
            v_blocked := true;  -- FIFO within the key: the rows of this key behind it wait for the caller
        END IF;
        ord := r.ord;
        new := v_new[r.ord];
        fence := v_fence;
        shard := v_shard;
        RETURN NEXT;
    END LOOP;
END
$$;


CREATE OR REPLACE FUNCTION keyed_promote_plain(
    p_keys text[], p_shards integer[], p_dispatch double precision, p_now timestamptz, p_local_holder text,
    p_local_lease double precision, p_local_queues text[], p_local_tasks text[], p_local_max integer)
RETURNS TABLE (key text, task_id text, attempt integer, nonce uuid, fence bigint, shard integer, queue text,
               message jsonb)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := COALESCE(p_now, now());
    v_key text;
    v_name text;
    v_shards integer[];
    v_budget integer;
    v_fair boolean;
    v_rated boolean;
    v_shard integer;
    v_fence bigint;
    v_nonce uuid;
    v_parked jsonb;
    v_local integer := CASE WHEN p_local_holder IS NULL THEN 0 ELSE COALESCE(p_local_max, 1) END;
    w record;
BEGIN
    -- The freed slot rows, locked in (key, shard) order, each by its primary key (0021).
    FOR v_key, v_shard IN
        SELECT DISTINCT x.key, x.shard FROM unnest(p_keys, p_shards) AS x(key, shard) ORDER BY 1, 2
    LOOP
        PERFORM 1 FROM keyed_slots s WHERE s.key = v_key AND s.shard = v_shard FOR UPDATE;
    END LOOP;
    FOR v_key, v_shards IN
        SELECT x.key, array_agg(DISTINCT x.shard) FROM unnest(p_keys, p_shards) AS x(key, shard)
         GROUP BY x.key ORDER BY x.key
    LOOP
        v_name := split_part(v_key, ':', 1);
        SELECT COALESCE(sum(GREATEST(keyed_row_share(v_key, v_now, s.shards,
                                                       keyed_name_shards(v_name), s.shard) - s.used, 0)), 0)
          INTO v_budget
          FROM keyed_slots s WHERE s.key = v_key AND s.shard = ANY(v_shards);
        CONTINUE WHEN v_budget = 0;
        PERFORM 1 FROM keyed_keys k WHERE k.key = v_key FOR UPDATE;
        -- Rows whose not-before time passed join the line first (their arrival number keeps their place, D2).
        UPDATE keyed_waiting wt SET not_before = NULL WHERE wt.key = v_key AND wt.not_before <= v_now;
        SELECT COALESCE(c.fair, false), COALESCE(c.rated, false) INTO v_fair, v_rated
          FROM (SELECT 1) one LEFT JOIN keyed_names c ON c.name = v_name;
        WHILE v_budget > 0 LOOP
            SELECT wt.task_id, wt.attempt, wt.group_key, wt.keys, wt.reserved_keys, wt.cost, wt.queue, wt.message,
                   wt.fair_key
              INTO w
              FROM keyed_waiting wt
             WHERE wt.key = v_key AND NOT wt.shadow AND wt.not_before IS NULL AND NOT wt.group_blocked
               AND (wt.deadline IS NULL OR wt.deadline > v_now)
             ORDER BY wt.priority DESC, wt.arrival
             LIMIT 1
               FOR UPDATE SKIP LOCKED;
            EXIT WHEN NOT FOUND;
            IF v_fair OR v_rated OR w.group_key IS NOT NULL OR w.keys IS NOT NULL OR w.reserved_keys IS NOT NULL
               OR w.cost >= 1073741824 THEN
                key := v_key; task_id := NULL; attempt := NULL; nonce := NULL; fence := NULL; shard := NULL;
                queue := NULL; message := NULL;
                RETURN NEXT;  -- not plain: the caller promotes the rest of this line
                EXIT;
            END IF;
            v_shard := NULL;
            UPDATE keyed_slots s SET used = s.used + w.cost
             WHERE (s.key, s.shard) = (
                    SELECT s2.key, s2.shard FROM keyed_slots s2
                     WHERE s2.key = v_key AND s2.shard = ANY(v_shards)
                       AND s2.used + w.cost <= keyed_row_share(v_key, v_now, s2.shards,
                                                                 keyed_name_shards(v_name), s2.shard)
                     ORDER BY s2.shard LIMIT 1)
               AND s.used + w.cost <= keyed_row_share(v_key, v_now, s.shards,
                                                        keyed_name_shards(v_name), s.shard)
            RETURNING s.shard INTO v_shard;
            EXIT WHEN v_shard IS NULL;  -- the head of the line waits for room; the room is kept for it (D10)
            DELETE FROM keyed_waiting wt WHERE wt.task_id = w.task_id AND wt.attempt = w.attempt AND NOT wt.shadow
            RETURNING to_jsonb(wt.*) INTO v_parked;
            IF v_local > 0 AND w.queue = ANY(p_local_queues)
               AND jsonb_typeof(w.message) = 'object' AND (w.message ->> 'task') = ANY(p_local_tasks) THEN
                v_nonce := NULL;
                INSERT INTO keyed_claims (task_id, attempt, key, shard, group_key, state, fence, holder,
                                          lease_expires_at, claimed_at, parked, cost, fair_key)
                VALUES (w.task_id, w.attempt, v_key, v_shard, NULL, 'running', nextval('keyed_fence_seq'),
                        p_local_holder, v_now + make_interval(secs => p_local_lease), v_now, v_parked, w.cost,
                        w.fair_key)
                RETURNING keyed_claims.fence INTO v_fence;
                v_local := v_local - 1;  -- a releaser runs one promotion itself; the others are dispatched (D4/D5)
            ELSE
                v_nonce := gen_random_uuid();
                INSERT INTO keyed_claims (task_id, attempt, key, shard, group_key, state, fence, nonce,
                                          dispatch_deadline, lease_expires_at, claimed_at, parked, cost, fair_key)
                VALUES (w.task_id, w.attempt, v_key, v_shard, NULL, 'promoted', nextval('keyed_fence_seq'), v_nonce,
                        v_now + make_interval(secs => p_dispatch), v_now + make_interval(secs => p_dispatch), v_now,
                        v_parked, w.cost, w.fair_key)
                RETURNING keyed_claims.fence INTO v_fence;
            END IF;
            UPDATE keyed_keys k SET waiting = k.waiting - 1, active_at = v_now WHERE k.key = v_key;
            key := v_key; task_id := w.task_id; attempt := w.attempt; nonce := v_nonce; fence := v_fence;
            shard := v_shard; queue := w.queue; message := w.message;
            RETURN NEXT;
            v_budget := v_budget - 1;
        END LOOP;
    END LOOP;
END
$$;


CREATE OR REPLACE FUNCTION keyed_admit_or_park_plain(
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
    v_layout integer;
    v_room integer;
    v_fence bigint;
    v_policy text;
BEGIN
    IF EXISTS (SELECT 1 FROM keyed_names c WHERE c.name = v_name AND c.rated) THEN
        RETURN QUERY SELECT 'general'::text, NULL::boolean, NULL::bigint, NULL::integer, ''::text;
        RETURN;
    END IF;
    IF p_park_only AND keyed_receipt_leaves_alone(p_key, v_now, v_shards) THEN
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
    -- A known task (a second delivery, a retry), an expired arrival or a group member: the general path. Asked one
    -- question at a time (0021): folded into one expression with v_new and p_deadline, the planner made a plan of its
    -- own for every call (a custom plan, cheaper once those values are constants), never keeping one.
    IF p_deadline <= v_now OR (NOT v_new AND (v_outcome IS NOT NULL OR v_finished >= p_attempt)) THEN
        RETURN QUERY SELECT 'general'::text, v_new, NULL::bigint, NULL::integer, ''::text;
        RETURN;
    END IF;
    IF NOT v_new THEN
        PERFORM 1 FROM keyed_claims k WHERE k.task_id = p_task_id AND k.attempt = p_attempt;
        IF NOT FOUND THEN
            PERFORM 1 FROM keyed_waiting w WHERE w.task_id = p_task_id AND w.attempt = p_attempt;
        END IF;
        IF FOUND THEN
            RETURN QUERY SELECT 'general'::text, v_new, NULL::bigint, NULL::integer, ''::text;
            RETURN;
        END IF;
    END IF;
    PERFORM 1 FROM keyed_group_members m WHERE m.task_id = p_task_id;
    IF FOUND THEN
        RETURN QUERY SELECT 'general'::text, v_new, NULL::bigint, NULL::integer, ''::text;
        RETURN;
    END IF;
    -- Every slot row of the key, created on first use (keyed_slots_ensure: the key's own layout), locked in shard
    -- order.
    SELECT count(*), min(s.shards) INTO v_locked, v_layout FROM (
        SELECT s.shards FROM keyed_slots s WHERE s.key = p_key ORDER BY s.shard FOR UPDATE) s;
    IF v_locked = 0 OR v_locked < v_layout THEN
        PERFORM keyed_slots_ensure(p_key, v_name);
        PERFORM 1 FROM keyed_slots s WHERE s.key = p_key ORDER BY s.shard FOR UPDATE;
    END IF;
    INSERT INTO keyed_keys (key, name, waiting, active_at) VALUES (p_key, v_name, 0, v_now)
    ON CONFLICT (key) DO UPDATE SET active_at = excluded.active_at;
    v_limit := keyed_key_limit(p_key, v_now);
    SELECT s.shard INTO v_room FROM keyed_slots s
     WHERE s.key = p_key AND s.used + 1 <= LEAST(keyed_shard_share(v_limit, s.shards, s.shard), keyed_shard_share(v_limit, v_shards, s.shard))
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
         WHERE s.key = p_key AND s.shard = v_room AND s.used + 1 <= LEAST(keyed_shard_share(v_limit, s.shards, s.shard), keyed_shard_share(v_limit, v_shards, s.shard))
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
