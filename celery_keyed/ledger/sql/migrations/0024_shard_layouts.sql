-- celery-keyed ledger migration 0024: the shards of a key follow its slot rows, not the name's configuration.
-- Every slot row carries the shard count its key's rows are laid out for (keyed_slots.shards, one value per key).
-- A share is the smaller of the row's share in its own layout and in the configured one (keyed_row_share), rows are
-- created for row 0's layout (keyed_slots_ensure), and a key moves to a new shard count only once every holding fits
-- it (keyed_reshard). Before this, a change of shards recomputed the shares without the rows' holdings: raising them
-- let a gate exceed its limit, and either direction could put an exclusive holder beside a shared one.

ALTER TABLE keyed_slots ADD COLUMN shards integer NOT NULL DEFAULT 1;
-- Existing keys: the configured count, or more where rows beyond it still exist (they drain: share 0 in the
-- configured layout).
UPDATE keyed_slots s
   SET shards = GREATEST(keyed_name_shards(s.name), (SELECT max(x.shard) + 1 FROM keyed_slots x WHERE x.key = s.key));
CREATE INDEX keyed_slots_layout_idx ON keyed_slots (name, shards) WHERE shard = 0;


CREATE FUNCTION keyed_row_share(p_key text, p_now timestamptz, p_layout integer, p_target integer, p_shard integer)
RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_limit integer;
BEGIN
    IF p_shard >= p_layout OR p_shard >= p_target THEN
        RETURN 0;
    END IF;
    v_limit := keyed_key_limit(p_key, p_now);
    RETURN LEAST(v_limit / p_layout + CASE WHEN p_shard < v_limit % p_layout THEN 1 ELSE 0 END,
                 v_limit / p_target + CASE WHEN p_shard < v_limit % p_target THEN 1 ELSE 0 END);
END
$$;


CREATE FUNCTION keyed_slots_ensure(p_key text, p_name text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_layout integer;
BEGIN
    FOR i IN 1 .. 5 LOOP  -- row 0 can be dropped as idle between the insert and the lock: insert it again
        INSERT INTO keyed_slots (key, shard, name, used, shards)
        VALUES (p_key, 0, p_name, 0, keyed_name_shards(p_name))
        ON CONFLICT (key, shard) DO NOTHING;
        SELECT s.shards INTO v_layout FROM keyed_slots s WHERE s.key = p_key AND s.shard = 0 FOR UPDATE;
        EXIT WHEN v_layout IS NOT NULL;
    END LOOP;
    INSERT INTO keyed_slots (key, shard, name, used, shards)
    SELECT p_key, g, p_name, 0, v_layout FROM generate_series(1, v_layout - 1) AS g
    ON CONFLICT (key, shard) DO NOTHING;
    RETURN v_layout;
END
$$;


CREATE FUNCTION keyed_reshard(p_key text, p_now timestamptz) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_name text;
    v_target integer;
    v_limit integer;
    v_layout integer;
    r record;
BEGIN
    FOR r IN SELECT s.shard, s.used, s.shards, s.name FROM keyed_slots s WHERE s.key = p_key ORDER BY s.shard
               FOR UPDATE
    LOOP
        IF v_layout IS NULL THEN
            v_layout := r.shards;
            v_name := r.name;
            v_target := keyed_name_shards(r.name);
            EXIT WHEN v_layout = v_target;
            v_limit := keyed_key_limit(p_key, COALESCE(p_now, now()));
        END IF;
        IF r.used > 0 AND (r.shard >= v_target OR r.used > keyed_shard_share(v_limit, v_target, r.shard)) THEN
            RETURN false;
        END IF;
    END LOOP;
    IF v_layout IS NULL OR v_layout = v_target THEN
        RETURN false;
    END IF;
    DELETE FROM keyed_slots s WHERE s.key = p_key AND s.shard >= v_target;
    UPDATE keyed_slots s SET shards = v_target WHERE s.key = p_key;
    INSERT INTO keyed_slots (key, shard, name, used, shards)
    SELECT p_key, g, v_name, 0, v_target FROM generate_series(0, v_target - 1) AS g
    ON CONFLICT (key, shard) DO NOTHING;
    RETURN true;
END
$$;


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
    v_rate double precision;
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
                   (SELECT c.rate FROM keyed_names c WHERE c.name = split_part(r.key, ':', 1))
              INTO v_shards, v_rate;
        END IF;
        v_shard := NULL;
        v_fence := NULL;
        IF NOT v_blocked AND v_new[r.ord] AND v_rate IS NULL AND (r.deadline IS NULL OR r.deadline > v_now) THEN
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


CREATE OR REPLACE FUNCTION keyed_release_many(
    p_task_ids text[], p_attempts integer[], p_fences bigint[], p_finals text[], p_details text[], p_now timestamptz)
RETURNS TABLE (ord integer, released boolean, recorded boolean, has_shadow boolean, key text,
               room_keys text[], room_shards integer[], room_free integer[])
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := COALESCE(p_now, now());
    n integer := COALESCE(cardinality(p_task_ids), 0);
    r record;
    c record;
    g record;
    v_released boolean[] := array_fill(false, ARRAY[n]);
    v_recorded boolean[] := array_fill(false, ARRAY[n]);
    v_first text[] := array_fill(NULL::text, ARRAY[n]);
    h_ord integer[] := '{}';
    h_key text[] := '{}';
    h_shard integer[] := '{}';
    h_cost integer[] := '{}';
    w_ord integer[] := '{}';
    w_key text[] := '{}';
    w_shard integer[] := '{}';
    r_ord integer[] := '{}';
    r_key text[] := '{}';
    r_shard integer[] := '{}';
    r_free integer[] := '{}';
    v_key text;
    v_waits boolean;
    v_free integer;
    v_rows integer;
BEGIN
    FOR r IN
        SELECT t.ord::integer AS ord, t.task_id, t.attempt, t.fence, t.final, t.detail
          FROM unnest(p_task_ids, p_attempts, p_fences, p_finals, p_details)
               WITH ORDINALITY AS t(task_id, attempt, fence, final, detail, ord)
         ORDER BY t.task_id, t.attempt, t.ord
    LOOP
        -- Release exactly once (§3.4): only the owner of this exact fence deletes the running claim.
        DELETE FROM keyed_claims k
         WHERE k.task_id = r.task_id AND k.attempt = r.attempt AND k.fence = r.fence AND k.state = 'running'
           AND k.group_key IS NULL
        RETURNING k.key, k.shard, k.cost, k.extra_keys, k.extra_shards INTO c;
        IF NOT FOUND THEN
            CONTINUE;  -- nothing to release (stale fence, second call, reaped), or a claim the general path takes
        END IF;
        v_released[r.ord] := true;
        v_first[r.ord] := c.key;
        -- The books: the task's one final outcome (guarded: outcome IS NULL), or the attempt is over (retry).
        UPDATE keyed_tasks t
           SET outcome = COALESCE(t.outcome, r.final),
               finished_at = COALESCE(t.finished_at, CASE WHEN r.final IS NOT NULL THEN v_now END),
               detail = CASE WHEN t.outcome IS NULL AND r.final IS NOT NULL THEN r.detail ELSE t.detail END,
               finished_attempt = GREATEST(t.finished_attempt, r.attempt)
         WHERE t.task_id = r.task_id AND (r.final IS NULL OR t.outcome IS NULL);
        GET DIAGNOSTICS v_rows = ROW_COUNT;
        v_recorded[r.ord] := r.final IS NOT NULL AND v_rows > 0;
        IF c.key IS NOT NULL THEN
            h_ord := h_ord || r.ord; h_key := h_key || c.key; h_shard := h_shard || c.shard; h_cost := h_cost || c.cost;
        END IF;
        IF c.extra_keys IS NOT NULL THEN
            h_ord := h_ord || array_fill(r.ord, ARRAY[cardinality(c.extra_keys)]);
            h_key := h_key || c.extra_keys;
            h_shard := h_shard || c.extra_shards;
            h_cost := h_cost || array_fill(c.cost, ARRAY[cardinality(c.extra_keys)]);
        END IF;
    END LOOP;

    -- Give every slot back to the shard it came from, one row at a time by primary key in (key, shard) order (the
    -- lock order: each UPDATE takes its row's lock). Row by row, never a join against the pairs: this function's
    -- plans are generic (0013), and a generic plan of such a join scans the whole of keyed_slots (0018).
    FOR g IN
        SELECT x.key, x.shard, sum(x.cost)::integer AS cost, min(min(x.ord)) OVER (PARTITION BY x.key) AS ord
          FROM unnest(h_ord, h_key, h_shard, h_cost) AS x(ord, key, shard, cost)
         GROUP BY x.key, x.shard
         ORDER BY x.key, x.shard
    LOOP
        UPDATE keyed_slots sl SET used = sl.used - g.cost WHERE sl.key = g.key AND sl.shard = g.shard;
        w_ord := w_ord || g.ord; w_key := w_key || g.key; w_shard := w_shard || g.shard;
    END LOOP;
    -- Who waits, read now: after every slot row's lock (a later statement, a new snapshot: an attempt parked by a
    -- transaction that held one before us is seen, D2). Where a key has parked attempts, each of its rows with room
    -- is reported at the first position that gave back a slot on that key. Without waiters (the common case) no
    -- room is reported and no limit is read.
    FOR i IN 1 .. cardinality(w_key) LOOP
        IF w_key[i] IS DISTINCT FROM v_key THEN
            v_key := w_key[i];
            v_waits := EXISTS (SELECT 1 FROM keyed_keys k WHERE k.key = v_key AND k.waiting > 0);
        END IF;
        CONTINUE WHEN NOT v_waits;
        SELECT GREATEST(keyed_row_share(sl.key, v_now, sl.shards, keyed_name_shards(sl.name), sl.shard)
                        - sl.used, 0)
          INTO v_free
          FROM keyed_slots sl WHERE sl.key = v_key AND sl.shard = w_shard[i];
        IF v_free > 0 THEN
            r_ord := r_ord || w_ord[i]; r_key := r_key || v_key; r_shard := r_shard || w_shard[i];
            r_free := r_free || v_free;
        END IF;
    END LOOP;
    RETURN QUERY
    SELECT i::integer, v_released[i], v_recorded[i],
           v_released[i] AND EXISTS (
               SELECT 1 FROM keyed_waiting w WHERE w.task_id = p_task_ids[i] AND w.attempt = p_attempts[i] AND w.shadow),
           v_first[i],
           ARRAY(SELECT x.key FROM unnest(r_ord, r_key) AS x(ord, key) WHERE x.ord = i),
           ARRAY(SELECT x.shard FROM unnest(r_ord, r_shard) AS x(ord, shard) WHERE x.ord = i),
           ARRAY(SELECT x.free FROM unnest(r_ord, r_free) AS x(ord, free) WHERE x.ord = i)
      FROM generate_series(1, n) AS i;
END
$$;


-- CREATE OR REPLACE resets the function's settings: its generic plans again (0013).
ALTER FUNCTION keyed_release_many(text[], integer[], bigint[], text[], text[], timestamptz)
    SET plan_cache_mode = force_generic_plan;

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
        SELECT COALESCE(c.fair, false), c.rate IS NOT NULL INTO v_fair, v_rated
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


CREATE OR REPLACE FUNCTION keyed_receipt_leaves_alone(p_key text, p_now timestamptz, p_shards integer)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    RETURN NOT EXISTS (
               SELECT 1 FROM keyed_waiting w
                WHERE w.key = p_key AND NOT w.shadow AND (w.not_before IS NULL OR w.not_before <= p_now)
                  AND NOT w.group_blocked AND (w.deadline IS NULL OR w.deadline > p_now))
           AND (EXISTS (
                    SELECT 1 FROM keyed_slots s
                     WHERE s.key = p_key
                       AND s.used + 1 <= keyed_row_share(p_key, p_now, s.shards, p_shards, s.shard))
                OR NOT EXISTS (SELECT 1 FROM keyed_slots s WHERE s.key = p_key));
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
    IF EXISTS (SELECT 1 FROM keyed_names c WHERE c.name = v_name AND c.rate IS NOT NULL) THEN
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
