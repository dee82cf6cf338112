-- 0020: a name's effective limit and its source, decided in the database once (issue 12 item 1). The operators'
-- readers computed them on their own, with different labels: status.py in SQL ('override' / 'config' / 'default'),
-- the Django admin in Python ('override' / 'configured' / default), beside keyed_effective_limit that every claim
-- reads. keyed_limits lists every configured or overridden name with keyed_effective_limit's rule and one set of
-- labels (those of status, the CLI, the metrics and the docs); status and the admin now read it. Nothing else changes.

-- Every name's effective limit at a time and where it comes from (0020): one row per name that is configured
-- (keyed_names) or has a live override, its limit by keyed_effective_limit's rule (the live override, else the
-- configured limit) and its source, 'override' or 'config'. A name it does not list has neither: its limit is 1
-- (a mutex), source 'default'. The one place the operators' readers take a name's limit and source from (status, the
-- metrics, the Django admin, each building a key's limit on it as keyed_key_limit does); claims keep reading
-- keyed_effective_limit (one name, its plans kept for the session). A function, not a view, to take the caller's now.
-- SQL, so that it is inlined into the statement that reads it: a filter on its name reaches the primary keys of
-- keyed_names and keyed_overrides (each branch of the UNION ALL lists a name once; no FULL JOIN, which would stop it).
CREATE FUNCTION keyed_limits(p_now timestamptz)
RETURNS TABLE (name text, slot_limit integer, source text, configured_limit integer, override_reason text,
               override_author text, override_expires_at timestamptz)
LANGUAGE sql STABLE AS $$
    SELECT c.name, COALESCE(o.slot_limit, c.slot_limit),
           CASE WHEN o.name IS NOT NULL THEN 'override' ELSE 'config' END,
           c.slot_limit, o.reason, o.author, o.expires_at
      FROM keyed_names c
      LEFT JOIN keyed_overrides o ON o.name = c.name AND (o.expires_at IS NULL OR o.expires_at > p_now)
    UNION ALL
    SELECT o.name, o.slot_limit, 'override', NULL, o.reason, o.author, o.expires_at
      FROM keyed_overrides o
     WHERE (o.expires_at IS NULL OR o.expires_at > p_now)
       AND NOT EXISTS (SELECT 1 FROM keyed_names c WHERE c.name = o.name)
$$;
