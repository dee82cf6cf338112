-- A rate's token bucket keeps its clock from going back (keyed_take_rate). A take is stamped with its
-- transaction's start (now()), and a transaction that began earlier can reach the key's row after a later one took
-- a token, having waited for the row's lock. Its take set the bucket's time back to its own stamp, so the next take
-- refilled the time between the two stamps a second time: more starts fit in a window than the rate allows (rate
-- 1/s, burst 2: three starts within half a second). The bucket is now refilled from, and stamped with, the later of
-- its own time and the take's; a take refused for want of tokens is parked until they exist counted from that time.

CREATE OR REPLACE FUNCTION keyed_take_rate(p_key text, p_name text, p_cost integer, p_now timestamptz,
                                OUT unrated boolean, OUT took boolean, OUT next_at timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := COALESCE(p_now, now());
    v_rate double precision;
    v_burst double precision;
    v_windows jsonb;
    v_avail double precision;
    v_clock timestamptz;
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
        -- The bucket's clock never goes back: v_now is this transaction's start, and one that began earlier can reach
        -- the row (it waited for its lock) after a later one took a token. Refilled from the later of the two, and
        -- stamped with it: the time between them is refilled once, not again at the next take.
        SELECT LEAST(v_burst, COALESCE(k.tokens, v_burst)
                     + v_rate * GREATEST(EXTRACT(EPOCH FROM v_now - COALESCE(k.tokens_at, v_now)), 0)),
               GREATEST(v_now, k.tokens_at)
          INTO v_avail, v_clock FROM keyed_keys k WHERE k.key = p_key;
        IF NOT FOUND THEN
            next_at := NULL;
            RETURN;
        END IF;
        IF v_avail < p_cost THEN
            next_at := v_clock + make_interval(secs => (p_cost - v_avail) / v_rate);
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
        UPDATE keyed_keys k SET tokens = v_avail - p_cost, tokens_at = v_clock WHERE k.key = p_key;
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
