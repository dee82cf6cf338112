-- 0010: the effective limit and the shard count of a name as PL/pgSQL functions (issue 12 item 4: CPU per cycle).
-- Same answers; as SQL functions with sub-selects they could not be inlined and were planned again at every call
-- (0.15-0.18 ms each, about five calls per release-and-promote and two per park); PL/pgSQL keeps the plans for the
-- session (about 0.04 ms). Every statement that reads them is unchanged.

-- The effective limit of a name at a time: the live override, else the configured limit, else 1 (mutex).
-- Read inside every claim statement, so a new override takes effect at the next claim with no cache (PL/pgSQL keeps
-- the plans of its two lookups for the session, not their answers; as a SQL function with sub-selects it could not
-- be inlined and was planned again at every call: 0.15-0.18 ms against 0.04, about five calls per release).
CREATE OR REPLACE FUNCTION keyed_effective_limit(p_name text, p_now timestamptz) RETURNS integer
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_limit integer;
BEGIN
    SELECT o.slot_limit INTO v_limit FROM keyed_overrides o
     WHERE o.name = p_name AND (o.expires_at IS NULL OR o.expires_at > p_now);
    IF v_limit IS NOT NULL THEN
        RETURN v_limit;
    END IF;
    SELECT c.slot_limit INTO v_limit FROM keyed_names c WHERE c.name = p_name;
    RETURN COALESCE(v_limit, 1);
END
$$;

-- Shards of a name (1 unless configured). PL/pgSQL for the same reason.
CREATE OR REPLACE FUNCTION keyed_name_shards(p_name text) RETURNS integer
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_shards integer;
BEGIN
    SELECT c.shards INTO v_shards FROM keyed_names c WHERE c.name = p_name;
    RETURN COALESCE(v_shards, 1);
END
$$;
