-- celery-keyed ledger migration 0027: group failure policies. What a group does when its head fails is chosen per
-- group name (keyed_names.group_failure, from the name's settings): 'halt' (the default, as before: the group waits
-- through the head's retries and moves on once its final failure is dead-lettered), 'skip' (a head that fails is
-- dead-lettered at once, even when it asked for a retry, and the next member starts), 'hold' (a head that fails holds
-- its group for an operator: nothing of the group starts until the group is resumed, or its head skipped). A held
-- group carries when, which head and why (keyed_groups.held_*); the operator's resume and skip, and every hold, are
-- ledger events.

ALTER TABLE keyed_names ADD COLUMN group_failure text NOT NULL DEFAULT 'halt';
ALTER TABLE keyed_names ADD CONSTRAINT keyed_names_group_failure_known
    CHECK (group_failure IN ('halt', 'skip', 'hold'));

ALTER TABLE keyed_groups ADD COLUMN held_since timestamptz;
ALTER TABLE keyed_groups ADD COLUMN held_task_id text;
ALTER TABLE keyed_groups ADD COLUMN held_reason text;
ALTER TABLE keyed_groups ADD CONSTRAINT keyed_groups_hold_whole
    CHECK ((held_since IS NULL) = (held_task_id IS NULL) AND (held_since IS NULL) = (held_reason IS NULL));
CREATE INDEX keyed_groups_held_idx ON keyed_groups (held_since) WHERE held_since IS NOT NULL;

-- keyed_group_failure: the failure policy of a group key's name ('halt' when the name has no row).
CREATE FUNCTION keyed_group_failure(p_group_key text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT COALESCE((SELECT n.group_failure FROM keyed_names n WHERE n.name = split_part(p_group_key, ':', 1)), 'halt')
$$;

ALTER TABLE keyed_events DROP CONSTRAINT keyed_events_kind_known;
ALTER TABLE keyed_events ADD CONSTRAINT keyed_events_kind_known
    CHECK (kind IN ('drift', 'forced_release', 'reclaimed', 'duplicate', 'retry_missing', 'failover', 'reasserted',
                    'group_held', 'group_resumed', 'group_head_skipped'));
