-- 0012: readers and writers per key (issue 14 item 6: concurrency_mode="shared" / "exclusive").
-- An exclusive attempt is stored with cost EXCLUSIVE_COST = 2^30 (celery_keyed/ledger/bounds.py): it is taken only
-- when the key's used is 0 (the guard FITS in ledger/slots.py, under the slot row's lock, on an unsharded name), and
-- while it is held no shared guard used + cost <= share can pass, whatever the limit becomes; its release gives back
-- the claim row's cost, so a limit lowered meanwhile never drives used below 0. No new table or column.
-- Here: keyed_promote_plain leaves a line whose head is exclusive to the general promotion (promote.promote_waiters,
-- which takes it with FITS once the key is idle); before, its guard used + cost <= share would stop that line for
-- ever. The body is 0005's with the one condition added.

-- keyed_promote_plain: give the free slots of the (key, shard) rows p_keys[i] / p_shards[i] to the next waiters of
-- their keys, key by key in key order, each line in its order (priority, then arrival: D10), as long as its head is
-- plain — one key, no group, no reservation, shared (not exclusive: migration 0012), on a name that is neither
-- fair nor rated. At the first head that is not plain the key's line stops and one row with task_id NULL names
-- the key: the caller promotes the rest of that line (promote.promote_waiters), in the same transaction. A head
-- that needs more slots than any of the given shards has free stops its line (the room stays for it).
-- Locks (lock order): every given slot row in (key, shard) order (a caller that holds them already holds them), then
-- the keys' head rows in key order. Each promotion takes its slot with the guarded UPDATE (D1), moves the waiting
-- row into a claim with a fresh nonce (D5) — or, for a releaser that runs it itself (p_local_holder set, its queue
-- and task listed: D4), into a running claim of that releaser, at most p_local_max of them — and counts it out of
-- the waiting room.
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
    PERFORM 1 FROM keyed_slots s
      WHERE (s.key, s.shard) IN (SELECT x.key, x.shard FROM unnest(p_keys, p_shards) AS x(key, shard))
      ORDER BY s.key, s.shard
        FOR UPDATE OF s;
    FOR v_key, v_shards IN
        SELECT x.key, array_agg(DISTINCT x.shard) FROM unnest(p_keys, p_shards) AS x(key, shard)
         GROUP BY x.key ORDER BY x.key
    LOOP
        v_name := split_part(v_key, ':', 1);
        SELECT COALESCE(sum(GREATEST(keyed_shard_share(keyed_effective_limit(v_name, v_now),
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
                       AND s2.used + w.cost <= keyed_shard_share(keyed_effective_limit(v_name, v_now),
                                                                 keyed_name_shards(v_name), s2.shard)
                     ORDER BY s2.shard LIMIT 1)
               AND s.used + w.cost <= keyed_shard_share(keyed_effective_limit(v_name, v_now),
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
