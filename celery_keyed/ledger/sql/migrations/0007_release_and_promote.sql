-- 0007: release-and-promote in one call (issue 12 item 2). A release that freed a slot with waiters cost two server
-- calls: keyed_release_many, then keyed_promote_plain (with `contended`: BEGIN, both, COMMIT — four round trips;
-- without it: two transactions, the freed slot visible to a sweeper in between). keyed_release_and_promote runs both
-- in one statement: one round trip, self-committing, and nobody sees the freed slot before its waiter has it.

-- keyed_release_and_promote: release a batch of claims without a group and give the rooms it frees to their keys'
-- next waiters, in one call and one transaction. It is keyed_release_many followed by keyed_promote_plain, unchanged,
-- so every guard and the lock order are theirs:
--   * release exactly once (DESIGN §3.4): a claim is given back only by the DELETE by token + fence + state
--     'running' + no group inside keyed_release_many (no row = nothing released);
--   * the books: one final outcome per task id (outcome IS NULL), inside keyed_release_many;
--   * lock order: claim and task rows token by token in (task id, attempt) order, then every slot row given back to
--     in (key, shard) order (keyed_release_many), then the head rows of the keys with waiters in key order
--     (keyed_promote_plain; the slot rows it locks again are held already);
--   * no lost wakeup (D2): who waits is read in a statement after the slot rows' locks were taken (a new snapshot:
--     an attempt parked by a transaction that held them before us is seen), and the promotion runs in the
--     transaction that made the room;
--   * the bound (D1): each promotion takes its slot with the guarded UPDATE used + cost <= share;
--   * FIFO (D10): each line in priority, then arrival order, while its head is plain (one key, no group, no
--     reservation, name neither fair nor rated); the first head that is not plain stops its line;
--   * admission token (D5) / local handoff (D4): a promotion gets a fresh nonce and a dispatch deadline, unless the
--     releasers run it themselves — every request that gave back a room with waiters names the same local set
--     (p_local_set[i], 0-based into p_local_sets: [{"queues": [...], "tasks": [...]}, ...]; NULL: none) and the
--     waiter's queue and task are in it: then it becomes a running claim of p_local_holder (no nonce), at most one
--     per such request.
-- Rows, in this order: kind 'release', one per input position (as keyed_release_many: ord, released, recorded,
-- has_shadow, key, and the (key, shard) rows it gave room on whose key has waiters — room_keys / room_shards, each at
-- the first position that gave back a slot on that key); then kind 'promotion', one per promoted attempt (key, task_id,
-- attempt, nonce, fence, shard, queue, message); then kind 'general' (key only) for a line whose head is not plain:
-- the caller promotes the rest of that line (promote.promote_waiters, in a transaction of its own: its room is
-- guarded meanwhile — arrivals never take a free slot while a promotable attempt waits, and the sweep promotes it if
-- the caller fails). Shadows (D8) are left to the caller too (has_shadow).
CREATE FUNCTION keyed_release_and_promote(
    p_task_ids text[], p_attempts integer[], p_fences bigint[], p_finals text[], p_details text[], p_now timestamptz,
    p_dispatch double precision, p_local_holder text, p_local_lease double precision, p_local_sets jsonb,
    p_local_set integer[])
RETURNS TABLE (kind text, ord integer, released boolean, recorded boolean, has_shadow boolean, key text,
               room_keys text[], room_shards integer[], task_id text, attempt integer, nonce uuid, fence bigint,
               shard integer, queue text, message jsonb)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    r record;
    v_keys text[] := '{}';
    v_shards integer[] := '{}';
    v_rooms integer := 0;
    v_set integer;
    v_one_set boolean := true;
    v_queues text[];
    v_tasks text[];
BEGIN
    -- The release and the waiter check (keyed_release_many: exactly once, the books, the give-back, D2).
    FOR r IN
        SELECT x.ord, x.released, x.recorded, x.has_shadow, x.key, x.room_keys, x.room_shards
          FROM keyed_release_many(p_task_ids, p_attempts, p_fences, p_finals, p_details, p_now) AS x
         ORDER BY x.ord
    LOOP
        kind := 'release'; ord := r.ord; released := r.released; recorded := r.recorded;
        has_shadow := r.has_shadow; key := r.key; room_keys := r.room_keys; room_shards := r.room_shards;
        task_id := NULL; attempt := NULL; nonce := NULL; fence := NULL; shard := NULL; queue := NULL;
        message := NULL;
        RETURN NEXT;
        IF cardinality(r.room_keys) > 0 THEN
            v_keys := v_keys || r.room_keys;
            v_shards := v_shards || r.room_shards;
            v_rooms := v_rooms + 1;
            -- Local handoff (D4) only when every request that gave back a room with waiters names the same set.
            IF v_rooms = 1 THEN
                v_set := p_local_set[r.ord];
            ELSIF v_set IS DISTINCT FROM p_local_set[r.ord] THEN
                v_one_set := false;
            END IF;
        END IF;
    END LOOP;
    IF v_rooms = 0 THEN
        RETURN;  -- nobody waits where room was made (the common case): the release alone
    END IF;
    IF v_one_set AND v_set IS NOT NULL THEN
        v_queues := ARRAY(SELECT jsonb_array_elements_text(p_local_sets -> v_set -> 'queues'));
        v_tasks := ARRAY(SELECT jsonb_array_elements_text(p_local_sets -> v_set -> 'tasks'));
    END IF;
    -- The promotion in the transaction that made the room (D2), each line FIFO (D10), the guarded take (D1), a nonce
    -- (D5) or a running claim of the releaser (D4, at most one per request with a room): keyed_promote_plain.
    FOR r IN
        SELECT x.key, x.task_id, x.attempt, x.nonce, x.fence, x.shard, x.queue, x.message
          FROM keyed_promote_plain(v_keys, v_shards, p_dispatch, p_now,
                                   CASE WHEN v_queues IS NULL THEN NULL ELSE p_local_holder END, p_local_lease,
                                   v_queues, v_tasks, v_rooms) AS x
    LOOP
        kind := CASE WHEN r.task_id IS NULL THEN 'general' ELSE 'promotion' END;
        ord := NULL; released := NULL; recorded := NULL; has_shadow := NULL; key := r.key; room_keys := NULL;
        room_shards := NULL; task_id := r.task_id; attempt := r.attempt; nonce := r.nonce; fence := r.fence;
        shard := r.shard; queue := r.queue; message := r.message;
        RETURN NEXT;
    END LOOP;
END
$$;
