-- celery-keyed slot ledger: the whole current schema, for a fresh database.
-- tests/migration checks that this file and every file of migrations/ applied in order give the same catalog.
-- Every object is prefixed keyed_. Lock order (docs/ledger.md): keyed_slots rows by (key, shard), then
-- keyed_keys rows by key, then keyed_groups rows by group_key. A statement that must take a lock out of this
-- order uses SKIP LOCKED / NOWAIT and leaves the work to the sweep.

-- Sequences: fences grow on every claim; arrival numbers order the waiting room (D10).
CREATE SEQUENCE keyed_fence_seq;
CREATE SEQUENCE keyed_arrival_seq;

-- Names: the configured limit and waiting room of every key "name:*" (synced from settings).
CREATE TABLE keyed_names (
    name text PRIMARY KEY,
    slot_limit integer NOT NULL,
    shards integer NOT NULL DEFAULT 1,
    max_waiting integer,
    max_wait double precision,
    overflow text NOT NULL DEFAULT 'reject',
    updated_at timestamptz NOT NULL DEFAULT now(),
    -- seconds a slot stays held after a hard time limit or a lost worker (the remote call may still run)
    uncertain_hold double precision,
    -- a token bucket per key: rate tokens per second, up to burst (1 when not set)
    rate double precision,
    burst double precision,
    -- waiters share a key's slots round-robin by their fair key (e.g. the tenant) instead of one FIFO line
    fair boolean NOT NULL DEFAULT false,
    CONSTRAINT keyed_names_limit_nonnegative CHECK (slot_limit >= 0),
    CONSTRAINT keyed_names_shards_range CHECK (shards BETWEEN 1 AND 1024),
    CONSTRAINT keyed_names_max_waiting_nonnegative CHECK (max_waiting >= 0),
    CONSTRAINT keyed_names_max_wait_positive CHECK (max_wait > 0),
    CONSTRAINT keyed_names_overflow_known CHECK (overflow IN ('reject', 'supersede')),
    CONSTRAINT keyed_names_uncertain_hold_positive CHECK (uncertain_hold > 0),
    CONSTRAINT keyed_names_rate_positive CHECK (rate > 0),
    CONSTRAINT keyed_names_burst_with_rate CHECK (burst IS NULL OR (rate IS NOT NULL AND burst >= 1))
);

-- Overrides: an operator's runtime limit for a name (0 pauses), who, why, until when.
CREATE TABLE keyed_overrides (
    name text PRIMARY KEY,
    slot_limit integer NOT NULL,
    reason text NOT NULL,
    author text NOT NULL DEFAULT '',
    expires_at timestamptz,
    set_at timestamptz NOT NULL,
    CONSTRAINT keyed_overrides_limit_nonnegative CHECK (slot_limit >= 0),
    CONSTRAINT keyed_overrides_reason_present CHECK (btrim(reason) <> '')
);

-- Override audit trail: one row per set, clear or lapse.
CREATE TABLE keyed_override_log (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name text NOT NULL,
    action text NOT NULL,
    old_limit integer,
    new_limit integer,
    reason text NOT NULL DEFAULT '',
    author text NOT NULL DEFAULT '',
    expires_at timestamptz,
    at timestamptz NOT NULL,
    CONSTRAINT keyed_override_log_action_known CHECK (action IN ('set', 'clear', 'expire'))
);
CREATE INDEX keyed_override_log_name_idx ON keyed_override_log (name, at);

-- Slots: one counter row per key and shard. used = claims that exist for (key, shard) (D1); the bound
-- used < share(limit) is checked by the guarded UPDATE that claims, under this row's lock.
CREATE TABLE keyed_slots (
    key text NOT NULL,
    shard integer NOT NULL,
    name text NOT NULL,
    used integer NOT NULL DEFAULT 0,
    PRIMARY KEY (key, shard),
    CONSTRAINT keyed_slots_used_nonnegative CHECK (used >= 0)
);

-- Keys: one head row per key. waiting = parked attempts of the key (D1), bounded by max_waiting.
CREATE TABLE keyed_keys (
    key text PRIMARY KEY,
    name text NOT NULL,
    waiting integer NOT NULL DEFAULT 0,
    active_at timestamptz NOT NULL,
    -- the token bucket of a rate-limited key: tokens left at tokens_at (refilled lazily, under this row's lock)
    tokens double precision,
    tokens_at timestamptz,
    CONSTRAINT keyed_keys_waiting_nonnegative CHECK (waiting >= 0)
);
CREATE INDEX keyed_keys_name_idx ON keyed_keys (name);

-- Holders: one row per worker process start (hostname + pid + start nonce, D6).
-- machine: the boot and process namespace its pids belong to; pids: its main and pool processes (heartbeat).
-- A holder whose machine is ours and whose pids are all gone is dead for sure: a restarted worker gives its
-- claims back at once instead of waiting a lease for the reaper.
CREATE TABLE keyed_holders (
    holder text PRIMARY KEY,
    hostname text NOT NULL,
    pid integer NOT NULL,
    started_at timestamptz NOT NULL,
    seen_at timestamptz NOT NULL,
    machine text,
    pids integer[]
);
CREATE INDEX keyed_holders_machine_idx ON keyed_holders (machine) WHERE machine IS NOT NULL;

-- Tasks: the books (D11). One row per task id that arrived; outcome is set exactly once, by a guarded
-- UPDATE ... WHERE outcome IS NULL. finished_attempt: attempts numbered <= it are over (D8).
CREATE TABLE keyed_tasks (
    task_id text PRIMARY KEY,
    task_name text NOT NULL DEFAULT '',
    key text,
    group_key text,
    arrived_at timestamptz NOT NULL,
    outcome text,
    finished_attempt integer NOT NULL DEFAULT -1,
    finished_at timestamptz,
    detail text NOT NULL DEFAULT '',
    duplicates integer NOT NULL DEFAULT 0,
    notified boolean NOT NULL DEFAULT false,
    CONSTRAINT keyed_tasks_outcome_known CHECK (outcome IN (
        'completed', 'failed', 'dead_lettered', 'expired', 'rejected', 'superseded', 'revoked', 'lost')),
    CONSTRAINT keyed_tasks_finished_when_outcome CHECK ((outcome IS NULL) = (finished_at IS NULL))
);
CREATE INDEX keyed_tasks_outcome_idx ON keyed_tasks (outcome, finished_at);
-- Outcomes of tasks that never ran and whose result is not stored yet (D11).
CREATE INDEX keyed_tasks_unnotified_idx ON keyed_tasks (finished_at)
    WHERE NOT notified AND outcome IN ('dead_lettered', 'expired', 'rejected', 'superseded', 'revoked', 'lost');
-- Finished task ids by finish time: the retention prune (keyed_books_retention) takes the oldest first.
CREATE INDEX keyed_tasks_finished_idx ON keyed_tasks (finished_at) WHERE outcome IS NOT NULL;

-- Books pruned: how many task ids of each final outcome reconcile pruned from keyed_tasks after the retention, so
-- the books still balance over every task id that ever arrived (counted in the statement that deletes the rows).
CREATE TABLE keyed_books_pruned (
    outcome text PRIMARY KEY,
    tasks bigint NOT NULL DEFAULT 0,
    CONSTRAINT keyed_books_pruned_outcome_known CHECK (outcome IN (
        'completed', 'failed', 'dead_lettered', 'expired', 'rejected', 'superseded', 'revoked', 'lost')),
    CONSTRAINT keyed_books_pruned_tasks_nonnegative CHECK (tasks >= 0)
);

-- Claims: the right of one attempt to execute. A row here is a held slot (of key/shard and/or of its
-- group); only the actor whose DELETE returns the row gives the slot back (release exactly once).
-- state 'promoted': handed to a parked attempt, waiting to be bound by its nonce (D5); parked keeps the
-- waiting row (message, place in line) so that a promotion nobody binds is put back where it was.
-- A claim holds its first key in (key, shard) and any further keys in extra_keys/extra_shards (same order),
-- cost slots of each, all taken in one transaction (all-or-nothing). state 'uncertain': the attempt is over
-- but its slots stay held until lease_expires_at because its remote call may still run; held_outcome says how
-- it ended.
CREATE TABLE keyed_claims (
    task_id text NOT NULL,
    attempt integer NOT NULL,
    key text,
    shard integer,
    group_key text,
    state text NOT NULL,
    fence bigint NOT NULL,
    holder text,
    nonce uuid,
    dispatch_deadline timestamptz,
    lease_expires_at timestamptz NOT NULL,
    claimed_at timestamptz NOT NULL,
    parked jsonb,
    cost integer NOT NULL DEFAULT 1,
    extra_keys text[],
    extra_shards integer[],
    held_outcome text,
    fair_key text,
    PRIMARY KEY (task_id, attempt),
    CONSTRAINT keyed_claims_state_known CHECK (state IN ('running', 'promoted', 'uncertain')),
    -- a running attempt that gave its slots back early (release_concurrency) keeps its row until its outcome
    CONSTRAINT keyed_claims_holds_something CHECK (key IS NOT NULL OR group_key IS NOT NULL OR state = 'running'),
    CONSTRAINT keyed_claims_shard_with_key CHECK ((key IS NULL) = (shard IS NULL)),
    CONSTRAINT keyed_claims_promoted_has_nonce CHECK (state <> 'promoted' OR (nonce IS NOT NULL AND parked IS NOT NULL)),
    CONSTRAINT keyed_claims_running_has_holder CHECK (state <> 'running' OR holder IS NOT NULL),
    CONSTRAINT keyed_claims_cost_positive CHECK (cost >= 1),
    CONSTRAINT keyed_claims_extra_with_key CHECK (extra_keys IS NULL OR key IS NOT NULL),
    CONSTRAINT keyed_claims_extra_shards_match CHECK (
        cardinality(extra_keys) IS NOT DISTINCT FROM cardinality(extra_shards)),
    CONSTRAINT keyed_claims_uncertain_has_outcome CHECK ((state = 'uncertain') = (held_outcome IS NOT NULL))
);
CREATE INDEX keyed_claims_slot_idx ON keyed_claims (key, shard);
CREATE INDEX keyed_claims_holder_idx ON keyed_claims (holder);
CREATE INDEX keyed_claims_lease_idx ON keyed_claims (lease_expires_at) WHERE state = 'running';
CREATE INDEX keyed_claims_dispatch_idx ON keyed_claims (dispatch_deadline) WHERE state = 'promoted';
CREATE INDEX keyed_claims_extra_idx ON keyed_claims USING gin (extra_keys) WHERE extra_keys IS NOT NULL;
CREATE INDEX keyed_claims_uncertain_idx ON keyed_claims (lease_expires_at) WHERE state = 'uncertain';
CREATE INDEX keyed_claims_fair_idx ON keyed_claims (key, fair_key) WHERE fair_key IS NOT NULL;
-- Backs the group rule (one attempt of a group runs at a time); groups have no override, so this index can
-- never conflict with a runtime limit (D1). The guard itself is the admission statement's head check.
CREATE UNIQUE INDEX keyed_claims_one_per_group ON keyed_claims (group_key) WHERE group_key IS NOT NULL;

-- Waiting room: parked attempts with their full message. A row is promotable when it is not a shadow
-- (D8), not before its not_before time (cleared by the sweep when due, D2), and not blocked by its group.
-- A parked attempt with several keys (keys, in the task's order) stands in the line of one key it lacks (key);
-- reserved_keys/reserved_shards: slots of keys listed before that one which it holds while it waits (counted in
-- keyed_slots.used; given back when it starts, leaves, or the reservation lapses). cost slots of each key.
CREATE TABLE keyed_waiting (
    task_id text NOT NULL,
    attempt integer NOT NULL,
    key text,
    group_key text,
    group_seq bigint,
    priority integer NOT NULL DEFAULT 0,
    arrival bigint NOT NULL,
    arrived_at timestamptz NOT NULL,
    not_before timestamptz,
    deadline timestamptz,
    supersede_key text,
    shadow boolean NOT NULL DEFAULT false,
    group_blocked boolean NOT NULL DEFAULT false,
    queue text,
    message jsonb NOT NULL,
    keys text[],
    cost integer NOT NULL DEFAULT 1,
    reserved_keys text[],
    reserved_shards integer[],
    reserved_at timestamptz,
    fair_key text,
    PRIMARY KEY (task_id, attempt),
    CONSTRAINT keyed_waiting_waits_for_something CHECK (key IS NOT NULL OR group_key IS NOT NULL),
    CONSTRAINT keyed_waiting_group_seq_with_group CHECK ((group_key IS NULL) = (group_seq IS NULL)),
    CONSTRAINT keyed_waiting_cost_positive CHECK (cost >= 1),
    CONSTRAINT keyed_waiting_keys_with_key CHECK (keys IS NULL OR key IS NOT NULL),
    CONSTRAINT keyed_waiting_reserved_shards_match CHECK (
        cardinality(reserved_keys) IS NOT DISTINCT FROM cardinality(reserved_shards)),
    CONSTRAINT keyed_waiting_reserved_when CHECK ((reserved_keys IS NULL) = (reserved_at IS NULL))
);
-- FIFO per key by priority then arrival, over promotable rows only, so promotion never walks past rows that
-- are not yet due, shadows or blocked group members.
CREATE INDEX keyed_waiting_ready_idx ON keyed_waiting (key, priority DESC, arrival)
    WHERE NOT shadow AND not_before IS NULL AND NOT group_blocked;
CREATE INDEX keyed_waiting_key_idx ON keyed_waiting (key);
CREATE INDEX keyed_waiting_group_idx ON keyed_waiting (group_key, group_seq) WHERE group_key IS NOT NULL;
CREATE INDEX keyed_waiting_not_before_idx ON keyed_waiting (not_before) WHERE not_before IS NOT NULL;
CREATE INDEX keyed_waiting_deadline_idx ON keyed_waiting (deadline) WHERE deadline IS NOT NULL;
CREATE INDEX keyed_waiting_fair_idx ON keyed_waiting (key, fair_key, priority DESC, arrival)
    WHERE NOT shadow AND not_before IS NULL AND NOT group_blocked;
CREATE INDEX keyed_waiting_reserved_idx ON keyed_waiting (reserved_at) WHERE reserved_at IS NOT NULL;
CREATE INDEX keyed_waiting_supersede_idx ON keyed_waiting (key, supersede_key) WHERE supersede_key IS NOT NULL;

-- Groups: one row per group_key, the lock of the group's admission and its sequence counter (D10).
CREATE TABLE keyed_groups (
    group_key text PRIMARY KEY,
    next_seq bigint NOT NULL DEFAULT 1
);

-- Group members: every task of a group from registration (at publish) or receipt until it finishes.
-- The head of a group is its member with the lowest seq; only the head may run.
CREATE TABLE keyed_group_members (
    group_key text NOT NULL,
    seq bigint NOT NULL,
    task_id text NOT NULL,
    received boolean NOT NULL DEFAULT false,
    registered_at timestamptz NOT NULL,
    PRIMARY KEY (group_key, seq),
    CONSTRAINT keyed_group_members_task_once UNIQUE (task_id)
);
CREATE INDEX keyed_group_members_unreceived_idx ON keyed_group_members (registered_at) WHERE NOT received;

-- Ledger facts: drift found by reconcile and forced releases (recorded breaches), for operators.
CREATE TABLE keyed_events (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind text NOT NULL,
    key text,
    task_id text,
    detail text NOT NULL DEFAULT '',
    at timestamptz NOT NULL,
    CONSTRAINT keyed_events_kind_known CHECK (kind IN ('drift', 'forced_release', 'reclaimed', 'duplicate'))
);
CREATE INDEX keyed_events_at_idx ON keyed_events (at);

-- The effective limit of a name at a time: the live override, else the configured limit, else 1 (mutex).
-- Read inside every claim statement, so a new override takes effect at the next claim with no cache.
CREATE FUNCTION keyed_effective_limit(p_name text, p_now timestamptz) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT COALESCE(
        (SELECT o.slot_limit FROM keyed_overrides o
          WHERE o.name = p_name AND (o.expires_at IS NULL OR o.expires_at > p_now)),
        (SELECT c.slot_limit FROM keyed_names c WHERE c.name = p_name),
        1)
$$;

-- Shards of a name (1 unless configured).
CREATE FUNCTION keyed_name_shards(p_name text) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT COALESCE((SELECT c.shards FROM keyed_names c WHERE c.name = p_name), 1)
$$;

-- The share of shard p_shard when p_limit slots are split over p_shards shards: shares sum to p_limit (D12);
-- a shard beyond the current count (after shards were lowered) has share 0 and only drains.
CREATE FUNCTION keyed_shard_share(p_limit integer, p_shards integer, p_shard integer) RETURNS integer
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN p_shard >= p_shards THEN 0
                ELSE p_limit / p_shards + CASE WHEN p_shard < p_limit % p_shards THEN 1 ELSE 0 END END
$$;
