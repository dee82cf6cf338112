-- The fast claim of a batch (keyed_claim_many) writes the claims it takes in one INSERT after its loop, not one
-- INSERT per claim: PostgreSQL sets up a table's CHECK constraints once per statement it runs (keyed_claims has
-- eleven), and that set-up was half of the cost of each claim row (88 us per row inserted one statement at a time,
-- 12 us in one statement, measured on a durable server). Same slots, same guards and lock order, same answers; the
-- failover guard still fires before any claim is written, and an error rolls the whole call back. A name's shard
-- count and rate are read once per name in a call, not once per key. The first use of a key of a single-shard name
-- is claimed here too (its slot row and head row created as keyed_admit_or_park_plain creates them), where it went
-- to a second round trip and a transaction of its own. The books' insert answers which task ids it recorded without
-- joining its answer back to the input (three hash joins per call).

CREATE OR REPLACE FUNCTION keyed_claim_many(
    p_task_ids text[], p_attempts integer[], p_task_names text[], p_keys text[], p_deadlines timestamptz[],
    p_costs integer[], p_fair_keys text[], p_holder text, p_lease double precision, p_now timestamptz)
RETURNS TABLE (ord integer, new boolean, fence bigint, shard integer)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := COALESCE(p_now, now());
    v_inserted text[];
    v_new boolean;
    r record;
    v_key text := NULL;
    v_name text := NULL;
    v_blocked boolean := false;
    v_shards integer;
    v_rated boolean;
    v_shard integer;
    v_fence bigint;
    -- the claims this call takes, written by one INSERT after the loop (c_*: one element per claim)
    c_task_ids text[] := '{}';
    c_attempts integer[] := '{}';
    c_keys text[] := '{}';
    c_shards integer[] := '{}';
    c_fences bigint[] := '{}';
    c_costs integer[] := '{}';
    c_fair_keys text[] := '{}';
BEGIN
    -- The books: one row per task id, inserted or locked in task id order (its first position's name and key); new
    -- only for the first position of a task id in the batch (a second delivery in the same batch is a known task).
    WITH ins AS (
        INSERT INTO keyed_tasks AS kt (task_id, task_name, key, group_key, arrived_at)
        SELECT DISTINCT ON (t.task_id) t.task_id, t.task_name, t.key, NULL, v_now
          FROM unnest(p_task_ids, p_task_names, p_keys) WITH ORDINALITY AS t(task_id, task_name, key, ord)
         ORDER BY t.task_id, t.ord
        ON CONFLICT (task_id) DO UPDATE SET task_id = excluded.task_id
        RETURNING kt.task_id, (kt.xmax = 0) AS new
    )
    SELECT COALESCE(array_agg(ins.task_id) FILTER (WHERE ins.new), '{}') INTO v_inserted FROM ins;

    FOR r IN
        SELECT t.key, t.ord::integer AS ord, t.task_id, t.attempt, t.deadline, t.cost, t.fair_key
          FROM unnest(p_keys, p_task_ids, p_attempts, p_deadlines, p_costs, p_fair_keys)
               WITH ORDINALITY AS t(key, task_id, attempt, deadline, cost, fair_key, ord)
         ORDER BY t.key, t.ord
    LOOP
        IF r.key IS DISTINCT FROM v_key THEN
            v_key := r.key;
            v_blocked := false;
            -- The name's shards and rate, read once per name in a call (the keys come sorted: a name's keys are
            -- mostly together).
            IF split_part(r.key, ':', 1) IS DISTINCT FROM v_name THEN
                v_name := split_part(r.key, ':', 1);
                SELECT keyed_name_shards(v_name),
                       COALESCE((SELECT c.rated FROM keyed_names c WHERE c.name = v_name), false)
                  INTO v_shards, v_rated;
            END IF;
        END IF;
        v_shard := NULL;
        v_fence := NULL;
        v_new := r.task_id = ANY(v_inserted) AND array_position(p_task_ids, r.task_id) = r.ord;
        IF NOT v_blocked AND v_new AND NOT v_rated AND (r.deadline IS NULL OR r.deadline > v_now) THEN
            IF v_shards = 1 THEN
                -- One row: the guarded UPDATE is the claim (D1, D2), its share read once. It takes the row's lock
                -- only when the guard holds, and READ COMMITTED re-evaluates the guard (a fresh share) on the row's
                -- newest version after waiting for that lock. A key whose rows still follow another shard count
                -- (before the sweep moves them) is tried on its row 0 only; refused, it takes the general path.
                FOR v_try IN 1 .. 2 LOOP
                    UPDATE keyed_slots s SET used = s.used + r.cost
                     WHERE s.key = r.key AND s.shard = 0
                       AND s.used + r.cost <= keyed_row_share(r.key, v_now, s.shards, v_shards, s.shard)
                       AND NOT EXISTS (
                           SELECT 1 FROM keyed_waiting w
                            WHERE w.key = r.key AND NOT w.shadow AND (w.not_before IS NULL OR w.not_before <= v_now)
                              AND NOT w.group_blocked AND (w.deadline IS NULL OR w.deadline > v_now))
                    RETURNING s.shard INTO v_shard;
                    EXIT WHEN v_shard IS NOT NULL OR v_try = 2
                              OR EXISTS (SELECT 1 FROM keyed_slots s WHERE s.key = r.key);
                    -- The key's first use (migration 0006): its slot row and its head row are created as
                    -- keyed_admit_or_park_plain creates them (keyed_slots_ensure: row 0 of the name's layout, locked;
                    -- then the head row), and the same guarded UPDATE takes the slot. Lock order as for any key:
                    -- its slot rows, then its head row, before the next key's.
                    PERFORM keyed_slots_ensure(r.key, v_name);
                    INSERT INTO keyed_keys AS k (key, name, waiting, active_at) VALUES (r.key, v_name, 0, v_now)
                    ON CONFLICT (key) DO UPDATE SET active_at = excluded.active_at;
                END LOOP;
            ELSE
                SELECT s.shard INTO v_shard FROM keyed_slots s
                 WHERE s.key = r.key AND s.used + r.cost <= keyed_row_share(r.key, v_now, s.shards, v_shards, s.shard)
                   AND NOT EXISTS (
                       SELECT 1 FROM keyed_waiting w
                        WHERE w.key = r.key AND NOT w.shadow AND (w.not_before IS NULL OR w.not_before <= v_now)
                          AND NOT w.group_blocked AND (w.deadline IS NULL OR w.deadline > v_now))
                 ORDER BY random() LIMIT 1
                   FOR UPDATE OF s SKIP LOCKED;
                IF v_shard IS NOT NULL THEN
                    -- The guard again under the lock: the bound holds even if the limit changed (D1).
                    UPDATE keyed_slots s SET used = s.used + r.cost
                     WHERE s.key = r.key AND s.shard = v_shard
                       AND s.used + r.cost <= keyed_row_share(r.key, v_now, s.shards, v_shards, s.shard)
                    RETURNING s.shard INTO v_shard;
                END IF;
            END IF;
            IF v_shard IS NOT NULL THEN
                -- The slot is taken: the claim is this call's (its row is written with the others, below).
                v_fence := nextval('keyed_fence_seq');
                c_task_ids := c_task_ids || r.task_id; c_attempts := c_attempts || r.attempt;
                c_keys := c_keys || r.key; c_shards := c_shards || v_shard; c_fences := c_fences || v_fence;
                c_costs := c_costs || r.cost; c_fair_keys := c_fair_keys || r.fair_key;
            END IF;
        END IF;
        IF v_fence IS NULL THEN
            v_blocked := true;  -- FIFO within the key: the rows of this key behind it wait for the caller
        END IF;
        ord := r.ord;
        new := v_new;
        fence := v_fence;
        shard := v_shard;
        RETURN NEXT;
    END LOOP;
    -- Every claim taken, in one statement: the table's checks are set up once per statement, not once per claim
    -- (they were half of a claim row's cost), and the failover guard asks once. The answers above are returned only
    -- when this succeeds: an error here (the guard after a failover) rolls back the whole call, slots included.
    IF cardinality(c_task_ids) > 0 THEN
        INSERT INTO keyed_claims (task_id, attempt, key, shard, group_key, state, fence, holder, lease_expires_at,
                                  claimed_at, cost, fair_key)
        SELECT c.task_id, c.attempt, c.key, c.shard, NULL, 'running', c.fence, p_holder,
               v_now + make_interval(secs => p_lease), v_now, c.cost, c.fair_key
          FROM unnest(c_task_ids, c_attempts, c_keys, c_shards, c_fences, c_costs, c_fair_keys)
               AS c(task_id, attempt, key, shard, fence, cost, fair_key);
    END IF;
END
$$;
