-- Limits computed from the call (a task's concurrency_limit: a callable or a template over its arguments).

-- The limit the latest arrival of a key computed from its call, stored with the key: keyed_key_limit reads it after
-- the operators' overrides (of the key, then of the name) and before the name's configured limit. Written before an
-- arrival (or a batch of them) is decided, in a transaction of its own (call_limits.store_first), which also gives
-- the room a new limit makes to the key's line (D2); only these writers lock the rows (claims only read them).
-- Reconcile deletes the rows no arrival has carried for a day (or keyed_idle_key_ttl if longer) whose keys are idle.
CREATE TABLE keyed_call_limits (
    key text PRIMARY KEY,
    name text NOT NULL,
    slot_limit integer NOT NULL,
    set_at timestamptz NOT NULL,  -- when an arrival set this value
    task_id text NOT NULL,  -- that arrival's task
    seen_at timestamptz NOT NULL,  -- the latest arrival carrying it, refreshed at most hourly (pruning reads it)
    CONSTRAINT keyed_call_limits_name_of_key CHECK (name = split_part(key, ':', 1)),
    CONSTRAINT keyed_call_limits_limit_nonnegative CHECK (slot_limit >= 0)
);
CREATE INDEX keyed_call_limits_name_idx ON keyed_call_limits (name);
CREATE INDEX keyed_call_limits_seen_at_idx ON keyed_call_limits (seen_at);

-- The effective limit of a key at a time: 0 while its name's effective limit is 0 (a paused name pauses every key)
-- or while the key is paused (keyed_key_overrides.paused_until in the future); else the key's own live limit; else
-- its name's live override; else the limit its latest call computed (keyed_call_limits); else its name's configured
-- limit (1 when none). Read inside every claim statement instead of the name's, so an override takes effect at the
-- next claim, and lapses by itself, with no cache. VOLATILE on purpose: each call reads with a fresh snapshot, so a
-- guard that calls it directly and is re-checked after waiting for a slot row's lock (READ COMMITTED re-evaluates
-- the WHERE clause on the row's newest version) sees a pause or a lowered key limit committed meanwhile. Every key
-- override that can stop claims (pause_key, set_key_limit) also rewrites the key's slot rows in its transaction,
-- so a claim racing it either commits before it or re-checks against it: once the pause is committed, no claim of
-- the key succeeds until it ends.
CREATE OR REPLACE FUNCTION keyed_key_limit(p_key text, p_now timestamptz) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_name text := split_part(p_key, ':', 1);
    v_limit integer;
    v_called integer;
    v_own integer;
    v_expires timestamptz;
    v_paused timestamptz;
BEGIN
    SELECT o.slot_limit INTO v_limit FROM keyed_overrides o
     WHERE o.name = v_name AND (o.expires_at IS NULL OR o.expires_at > p_now);
    IF v_limit IS NULL THEN
        SELECT c.slot_limit INTO v_limit FROM keyed_names c WHERE c.name = v_name;
        v_limit := COALESCE(v_limit, 1);
        IF v_limit > 0 THEN
            SELECT l.slot_limit INTO v_called FROM keyed_call_limits l WHERE l.key = p_key;
            v_limit := COALESCE(v_called, v_limit);
        END IF;
    END IF;
    IF v_limit = 0 AND v_called IS NULL THEN
        RETURN 0;  -- the name is paused (by an override or its configuration): every key is
    END IF;
    SELECT o.slot_limit, o.expires_at, o.paused_until INTO v_own, v_expires, v_paused
      FROM keyed_key_overrides o WHERE o.key = p_key;
    IF NOT FOUND THEN
        RETURN v_limit;
    END IF;
    IF v_paused > p_now THEN
        RETURN 0;
    END IF;
    IF v_own IS NOT NULL AND (v_expires IS NULL OR v_expires > p_now) THEN
        RETURN v_own;
    END IF;
    RETURN v_limit;
END
$$;
