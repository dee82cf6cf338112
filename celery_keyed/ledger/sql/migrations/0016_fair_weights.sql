-- 0016: weighted fair sharing (issue 14 item 5). A fair name's waiters share a key's slots by the weight of their
-- fair key: promotion picks the head of the fair key with the lowest (slots it holds of the key) / weight, ties by
-- priority then arrival (waiting.WAITING_NEXT_FAIR), so while several fair keys wait each one's share of the slots
-- follows its weight. A fair key's weight: a live runtime override (keyed_fair_weight_overrides, longest matching
-- prefix), else the weight its head's call carries (keyed_waiting.fair_weight), else the name's configured table
-- (keyed_names.fair_weights, longest matching prefix), else 1 (keyed_fair_weight).

-- {"fair-key prefix": weight, ...} from keyed_fair_weights in the settings (validated by names.NameConfig).
ALTER TABLE keyed_names ADD COLUMN fair_weights jsonb;
ALTER TABLE keyed_names ADD CONSTRAINT keyed_names_fair_weights_object
    CHECK (fair_weights IS NULL OR jsonb_typeof(fair_weights) = 'object');

-- The weight the parked call carries (task option / header fair_weight); NULL: none.
ALTER TABLE keyed_waiting ADD COLUMN fair_weight double precision;
ALTER TABLE keyed_waiting ADD CONSTRAINT keyed_waiting_fair_weight_positive CHECK (fair_weight > 0);

-- Fair weight overrides: an operator's runtime weight for the fair keys of a name that equal prefix or start with
-- prefix followed by ':', who, why, until when.
CREATE TABLE keyed_fair_weight_overrides (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text NOT NULL,
    prefix text NOT NULL,
    weight double precision NOT NULL,
    reason text NOT NULL,
    author text NOT NULL DEFAULT '',
    expires_at timestamptz,
    set_at timestamptz NOT NULL,
    CONSTRAINT keyed_fair_weight_overrides_one_per_prefix UNIQUE (name, prefix),
    CONSTRAINT keyed_fair_weight_overrides_weight_positive CHECK (weight > 0),
    CONSTRAINT keyed_fair_weight_overrides_reason_present CHECK (btrim(reason) <> '')
);

-- Fair weight audit trail: one row per set, clear or lapse (as keyed_override_log for limits).
CREATE TABLE keyed_fair_weight_log (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text NOT NULL,
    prefix text NOT NULL,
    action text NOT NULL,
    old_weight double precision,
    new_weight double precision,
    reason text NOT NULL DEFAULT '',
    author text NOT NULL DEFAULT '',
    expires_at timestamptz,
    at timestamptz NOT NULL,
    CONSTRAINT keyed_fair_weight_log_action_known CHECK (action IN ('set', 'clear', 'expire'))
);
CREATE INDEX keyed_fair_weight_log_name_idx ON keyed_fair_weight_log (name, at);

-- The weight of fair key p_fair_key of name p_name, whose head carries p_task_weight (NULL: none). A prefix matches
-- a fair key equal to it or starting with it and ':' ("tenant" matches "tenant:7"; "tenant:big" matches
-- "tenant:big" and "tenant:big:eu", never "tenant:bigger"); the longest matching prefix wins.
CREATE FUNCTION keyed_fair_weight(p_name text, p_fair_key text, p_task_weight double precision,
                                  p_now timestamptz) RETURNS double precision
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_weight double precision;
BEGIN
    SELECT o.weight INTO v_weight FROM keyed_fair_weight_overrides o
     WHERE o.name = p_name AND (o.expires_at IS NULL OR o.expires_at > COALESCE(p_now, now()))
       AND (p_fair_key = o.prefix OR starts_with(p_fair_key, o.prefix || ':'))
     ORDER BY length(o.prefix) DESC LIMIT 1;
    IF v_weight IS NOT NULL THEN
        RETURN v_weight;
    END IF;
    IF p_task_weight IS NOT NULL THEN
        RETURN p_task_weight;
    END IF;
    SELECT CAST(w.value AS double precision) INTO v_weight
      FROM keyed_names c CROSS JOIN LATERAL jsonb_each_text(c.fair_weights) AS w(prefix, value)
     WHERE c.name = p_name AND (p_fair_key = w.prefix OR starts_with(p_fair_key, w.prefix || ':'))
     ORDER BY length(w.prefix) DESC LIMIT 1;
    RETURN COALESCE(v_weight, 1.0);
END
$$;
