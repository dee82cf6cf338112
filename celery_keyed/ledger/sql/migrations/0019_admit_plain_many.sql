-- 0019: admit-or-park of a batch of plain arrivals in one round trip (issue 12 item 3, issue 13: a burst of arrivals
-- parked at receipt or at admission cost one call per arrival; the promotions published meanwhile queued behind them
-- in the broker). A procedure that commits after each arrival: the same transactions as the one-by-one calls.

-- keyed_admit_plain_many: admit-or-park of a batch of plain arrivals (each as keyed_admit_or_park_plain decides it,
-- p_park_only for the receipt service) in ONE round trip and, like the one-by-one calls it replaces, one transaction
-- per arrival: a procedure that commits after each, so the locks, the lock order and the guards of each arrival are
-- exactly keyed_admit_or_park_plain's and nothing is held from one arrival to the next (a batch in one transaction
-- would hold the key rows of its first arrivals while locking the task rows of later ones, against the lock order).
-- Arrivals are decided in input order (FIFO within a key, D10). Answers, per input position: verdicts 'admitted' /
-- 'parked' / 'rejected' (decided and committed), 'general' / 'undecided' (as keyed_admit_or_park_plain: the caller
-- decides it), 'error' (its statement failed and was rolled back, nothing of it is written; details holds SQLSTATE
-- and message: the caller decides it on its own, where the error is reported as usual) or 'skipped' (an earlier
-- arrival of its key was not decided here — or, with p_in_order, any earlier arrival: untouched, the caller decides
-- it after that one, so the batch's parked rows are numbered in input order as one-by-one calls number them); news,
-- fences, shards, details as keyed_admit_or_park_plain answers them. Must be called outside a transaction block
-- (autocommit).
CREATE PROCEDURE keyed_admit_plain_many(
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
    END LOOP;
END
$$;
