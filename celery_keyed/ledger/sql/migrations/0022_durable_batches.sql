-- 0022: durable commits through a connection pooler. Behind a pooler the ledger sets synchronous_commit per
-- transaction (SET LOCAL, celery_keyed.ledger.session), and a setting local to a transaction ends with it: the
-- procedure below commits after each arrival, so every arrival after the first committed with the server's default —
-- possibly off, when a parked row (the only copy of a message the worker then acknowledges) must survive a crash.
-- keyed_admit_plain_many now carries the caller's synchronous_commit into each of its transactions.

CREATE OR REPLACE PROCEDURE keyed_admit_plain_many(
    p_task_ids text[], p_attempts integer[], p_task_names text[], p_keys text[], p_priorities integer[],
    p_deadlines timestamptz[], p_queues text[], p_messages text[], p_fair_keys text[], p_holder text,
    p_lease double precision, p_now timestamptz, p_park_only boolean, p_in_order boolean,
    INOUT verdicts text[] DEFAULT NULL, INOUT news boolean[] DEFAULT NULL, INOUT fences bigint[] DEFAULT NULL,
    INOUT shards integer[] DEFAULT NULL, INOUT details text[] DEFAULT NULL)
LANGUAGE plpgsql AS $$
DECLARE
    n integer := COALESCE(cardinality(p_task_ids), 0);
    r record;
    v_stopped text[] := '{}';
    v_stop_all boolean := false;
    v_sync text := current_setting('synchronous_commit');
BEGIN
    verdicts := '{}'; news := '{}'; fences := '{}'; shards := '{}'; details := '{}';
    FOR i IN 1 .. n LOOP
        IF v_stop_all OR p_keys[i] = ANY(v_stopped) THEN
            verdicts := verdicts || 'skipped'::text; news := news || NULL::boolean; fences := fences || NULL::bigint;
            shards := shards || NULL::integer; details := details || ''::text;
            CONTINUE;
        END IF;
        BEGIN
            SELECT * INTO r FROM keyed_admit_or_park_plain(
                p_task_ids[i], p_attempts[i], p_task_names[i], p_keys[i], p_priorities[i], p_deadlines[i], p_queues[i],
                p_messages[i]::jsonb, p_fair_keys[i], p_holder, p_lease, p_now, p_park_only);
            verdicts := verdicts || r.verdict; news := news || r.new; fences := fences || r.fence;
            shards := shards || r.shard; details := details || r.detail;
        EXCEPTION WHEN OTHERS THEN
            verdicts := verdicts || 'error'::text; news := news || NULL::boolean; fences := fences || NULL::bigint;
            shards := shards || NULL::integer; details := details || (SQLSTATE || ': ' || SQLERRM);
        END;
        IF verdicts[i] NOT IN ('admitted', 'parked', 'rejected') THEN
            v_stopped := v_stopped || p_keys[i];  -- the later arrivals of its key wait for its decision (D10)
            v_stop_all := p_in_order;
        END IF;
        COMMIT;
        PERFORM set_config('synchronous_commit', v_sync, true);  -- the caller's, for every arrival's commit
    END LOOP;
END
$$;
