-- Caps and borrowing: a cap on all the keys of a name together, and keys that borrow the cap's idle room.

ALTER TABLE keyed_names
    -- a cap on all the keys of the name together: every task of a key of it also takes a slot of the key
    -- "<name>#cap" (its own name row, slot_limit = cap: names.names_upsert); borrow: while no task waits for that
    -- cap, a key may run up to the cap instead of its own limit (keyed_key_limit)
    ADD COLUMN cap integer,
    ADD COLUMN borrow boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT keyed_names_cap_range CHECK (cap BETWEEN 1 AND 1073741823),
    ADD CONSTRAINT keyed_names_borrow_with_cap CHECK (NOT borrow OR cap IS NOT NULL);

-- The effective limit of a key at a time: 0 while its name's effective limit is 0 (a paused name pauses every key)
-- or while the key is paused (keyed_key_overrides.paused_until in the future); else the key's own live limit; else
-- its name's live override; else the limit its latest call computed (keyed_call_limits); else its name's configured
-- limit (1 when none); any of the last three raised to the name's cap while the name borrows and no task waits for
-- the cap. Read inside every claim statement instead of the name's, so an override takes effect at the
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
    v_configured integer;
    v_cap integer;
    v_called integer;
    v_own integer;
    v_expires timestamptz;
    v_paused timestamptz;
BEGIN
    SELECT c.slot_limit, CASE WHEN c.borrow THEN c.cap END INTO v_configured, v_cap
      FROM keyed_names c WHERE c.name = v_name;
    SELECT o.slot_limit INTO v_limit FROM keyed_overrides o
     WHERE o.name = v_name AND (o.expires_at IS NULL OR o.expires_at > p_now);
    IF v_limit IS NULL THEN
        v_limit := COALESCE(v_configured, 1);
        IF v_limit > 0 THEN
            SELECT l.slot_limit INTO v_called FROM keyed_call_limits l WHERE l.key = p_key;
            v_limit := COALESCE(v_called, v_limit);
        END IF;
    END IF;
    IF v_limit = 0 AND v_called IS NULL THEN
        RETURN 0;  -- the name is paused (by an override or its configuration): every key is
    END IF;
    -- Borrowing: while no task waits for its name's cap (none stands in the line of "<name>#cap"), a key may run up
    -- to the cap; the cap's own slot row bounds the name's keys together.
    IF v_cap > v_limit AND v_limit > 0 AND NOT EXISTS (
        SELECT 1 FROM keyed_waiting w
         WHERE w.key = v_name || '#cap' AND NOT w.shadow AND (w.not_before IS NULL OR w.not_before <= p_now)
           AND NOT w.group_blocked AND (w.deadline IS NULL OR w.deadline > p_now)) THEN
        v_limit := v_cap;
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
