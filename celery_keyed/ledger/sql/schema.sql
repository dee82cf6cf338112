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
    -- the keyed_config_version of the settings that stored this row; a worker with a lower version never
    -- overwrites it (names.NAMES_UPSERT: ON CONFLICT ... WHERE config_version <= the worker's)
    config_version integer NOT NULL DEFAULT 0,
    CONSTRAINT keyed_names_limit_nonnegative CHECK (slot_limit >= 0),
    CONSTRAINT keyed_names_shards_range CHECK (shards BETWEEN 1 AND 1024),
    CONSTRAINT keyed_names_max_waiting_nonnegative CHECK (max_waiting >= 0),
    CONSTRAINT keyed_names_max_wait_positive CHECK (max_wait > 0),
    CONSTRAINT keyed_names_overflow_known CHECK (overflow IN ('reject', 'supersede')),
    CONSTRAINT keyed_names_uncertain_hold_positive CHECK (uncertain_hold > 0),
    CONSTRAINT keyed_names_rate_positive CHECK (rate > 0),
    CONSTRAINT keyed_names_burst_with_rate CHECK (burst IS NULL OR (rate IS NOT NULL AND burst >= 1)),
    -- weighted fair sharing (0016): {"fair-key prefix": weight, ...} from keyed_fair_weights (keyed_fair_weight)
    fair_weights jsonb,
    CONSTRAINT keyed_names_fair_weights_object CHECK (fair_weights IS NULL OR jsonb_typeof(fair_weights) = 'object'),
    -- what a group of this name does when its head fails (0027): halt (wait through retries, move on after the
    -- final failure), skip (dead-letter the head at once, move on), hold (wait for an operator)
    group_failure text NOT NULL DEFAULT 'halt',
    CONSTRAINT keyed_names_group_failure_known CHECK (group_failure IN ('halt', 'skip', 'hold')),
    -- rate windows per key: [[N, seconds], ...], at most N starts in any window of that many seconds (keyed_take_rate)
    windows jsonb,
    CONSTRAINT keyed_names_windows_array CHECK (windows IS NULL OR jsonb_typeof(windows) = 'array'),
    -- whether a start of a key of this name takes from a rate limit (a token bucket, windows or both)
    rated boolean NOT NULL GENERATED ALWAYS AS (rate IS NOT NULL OR windows IS NOT NULL) STORED,
    -- a cap on all the keys of the name together: every task of a key of it also takes a slot of the key
    -- "<name>#cap" (its own name row, slot_limit = cap: names.names_upsert); borrow: while no task waits for that
    -- cap, a key may run up to the cap instead of its own limit (keyed_key_limit)
    cap integer,
    borrow boolean NOT NULL DEFAULT false,
    CONSTRAINT keyed_names_cap_range CHECK (cap BETWEEN 1 AND 1073741823),
    CONSTRAINT keyed_names_borrow_with_cap CHECK (NOT borrow OR cap IS NOT NULL)
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

-- Override audit trail: one row per set, clear or lapse of a name's override, and (0014) per set, clear, lapse,
-- pause or resume of a key's (key set: the key; name: its name). A pause is new_limit 0 until expires_at; its end
-- ('resume', by hand or by the sweep when it lapsed) is old_limit 0.
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
    key text,
    CONSTRAINT keyed_override_log_action_known CHECK (action IN ('set', 'clear', 'expire', 'pause', 'resume'))
);
CREATE INDEX keyed_override_log_name_idx ON keyed_override_log (name, at);
CREATE INDEX keyed_override_log_key_idx ON keyed_override_log (key, at) WHERE key IS NOT NULL;

-- Key overrides (0014): a runtime limit and / or a pause of ONE key (not its whole name), set by an operator or by a
-- task of the key (self.keyed_set_limit / self.keyed_pause, e.g. on a 429 with Retry-After). slot_limit replaces the
-- name's limit for this key until expires_at (NULL: until cleared); paused_until: nothing new of the key starts
-- before then (running attempts go on). Both stop applying by themselves (keyed_key_limit compares them with the
-- time of the claim); the sweep then clears them, logs it and promotes the key's waiters. A paused name pauses every
-- key whatever its key override. Lock order: a key override row comes before every other row (its writers lock it
-- first; claims only read it).
CREATE TABLE keyed_key_overrides (
    key text PRIMARY KEY,
    name text NOT NULL,
    slot_limit integer,
    expires_at timestamptz,
    reason text,
    author text NOT NULL DEFAULT '',
    set_at timestamptz,
    paused_until timestamptz,
    pause_reason text,
    pause_author text NOT NULL DEFAULT '',
    paused_at timestamptz,
    CONSTRAINT keyed_key_overrides_name_of_key CHECK (name = split_part(key, ':', 1)),
    CONSTRAINT keyed_key_overrides_limit_nonnegative CHECK (slot_limit >= 0),
    -- a limit has its reason and time, a pause its own: neither without the other, never a blank reason
    CONSTRAINT keyed_key_overrides_limit_reason CHECK (
        (slot_limit IS NULL) = (reason IS NULL) AND (slot_limit IS NULL) = (set_at IS NULL) AND btrim(reason) <> ''),
    CONSTRAINT keyed_key_overrides_pause_reason CHECK (
        (paused_until IS NULL) = (pause_reason IS NULL) AND (paused_until IS NULL) = (paused_at IS NULL)
        AND btrim(pause_reason) <> '')
);
CREATE INDEX keyed_key_overrides_name_idx ON keyed_key_overrides (name);
-- The sweep finds the pauses and limits that lapsed without reading the rest.
CREATE INDEX keyed_key_overrides_paused_idx ON keyed_key_overrides (paused_until) WHERE paused_until IS NOT NULL;
CREATE INDEX keyed_key_overrides_expires_idx ON keyed_key_overrides (expires_at) WHERE expires_at IS NOT NULL;

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

-- Fair weight overrides (0016): an operator's runtime weight for the fair keys of a name that equal prefix or start
-- with prefix followed by ':', who, why, until when (keyed_fair_weight reads them).
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

-- Slots: one counter row per key and shard. used = claims that exist for (key, shard) (D1); the bound
-- used < share(limit) is checked by the guarded UPDATE that claims, under this row's lock.
CREATE TABLE keyed_slots (
    key text NOT NULL,
    shard integer NOT NULL,
    name text NOT NULL,
    used integer NOT NULL DEFAULT 0,
    -- the shard count this key's rows are laid out for (every row of a key carries the same): shares follow the
    -- rows, not the name's current configuration (keyed_row_share, keyed_reshard)
    shards integer NOT NULL DEFAULT 1,
    PRIMARY KEY (key, shard),
    CONSTRAINT keyed_slots_used_nonnegative CHECK (used >= 0)
);
-- The keys whose rows follow another shard count than their name's (the sweep moves them: slots.py): by name,
-- row 0 only, no column a claim or release writes (their updates stay HOT).
CREATE INDEX keyed_slots_layout_idx ON keyed_slots (name, shards) WHERE shard = 0;

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

-- Rate windows (keyed_names.windows): per key, the times of its latest starts, as a ring of `ring` rows (the
-- name's largest N) that position `pos` (the key's count of starts so far) overwrites at slot pos % ring; a start
-- of cost c fits every window [N, T] when the start at position next_pos + c - 1 - N is T old (O(1) per window, exact:
-- at most N starts in any T seconds). Taken beside the token bucket under the key's head row lock, all or none
-- (keyed_take_rate). Kept apart from keyed_keys (a daily quota outlives an idle key's row); reconcile deletes a key's
-- rows once its latest start is older than its name's longest window (windows.prune).
CREATE TABLE keyed_windows (
    key text PRIMARY KEY,
    name text NOT NULL,
    next_pos bigint NOT NULL,  -- the position the key's next start takes
    ring integer NOT NULL,  -- the ring's size when last written (a changed one re-slots the rows kept)
    last_at timestamptz NOT NULL,  -- the latest start's time (starts are recorded in order: never before it)
    CONSTRAINT keyed_windows_ring_positive CHECK (ring > 0)
);
CREATE TABLE keyed_window_starts (
    key text NOT NULL REFERENCES keyed_windows (key) ON DELETE CASCADE,
    slot integer NOT NULL,
    pos bigint NOT NULL,
    at timestamptz NOT NULL,
    PRIMARY KEY (key, slot)
);

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
    pids integer[],
    -- the keyed_config_version this worker process started with (NULL: a worker older than 0006)
    config_version integer
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
    -- the stored message of a parked task booked never-ran (0025): its canvas context for storing its result
    message jsonb,
    -- a task of several keys: its keys after the first (key), as it arrived (0031); NULL for one key
    extra_keys text[],
    CONSTRAINT keyed_tasks_outcome_known CHECK (outcome IN (
        'completed', 'failed', 'dead_lettered', 'expired', 'rejected', 'superseded', 'revoked', 'lost')),
    CONSTRAINT keyed_tasks_finished_when_outcome CHECK ((outcome IS NULL) = (finished_at IS NULL)),
    -- a message is kept only until the task's result is stored
    CONSTRAINT keyed_tasks_message_until_notified CHECK (message IS NULL OR NOT notified)
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
    -- newest wins (0015): the supersede key of a claim admitted directly (a promoted claim keeps it in parked), and
    -- when and by whom its cancellation was asked (on_newer='cancel_running'); set once, gone with the claim
    supersede_key text,
    cancel_requested_at timestamptz,
    cancel_detail text,
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
    CONSTRAINT keyed_claims_uncertain_has_outcome CHECK ((state = 'uncertain') = (held_outcome IS NOT NULL)),
    CONSTRAINT keyed_claims_cancel_detail_when CHECK ((cancel_requested_at IS NULL) = (cancel_detail IS NULL))
);
CREATE INDEX keyed_claims_slot_idx ON keyed_claims (key, shard);
CREATE INDEX keyed_claims_holder_idx ON keyed_claims (holder);
CREATE INDEX keyed_claims_lease_idx ON keyed_claims (lease_expires_at) WHERE state = 'running';
CREATE INDEX keyed_claims_dispatch_idx ON keyed_claims (dispatch_deadline) WHERE state = 'promoted';
CREATE INDEX keyed_claims_extra_idx ON keyed_claims USING gin (extra_keys) WHERE extra_keys IS NOT NULL;
CREATE INDEX keyed_claims_uncertain_idx ON keyed_claims (lease_expires_at) WHERE state = 'uncertain';
CREATE INDEX keyed_claims_fair_idx ON keyed_claims (key, fair_key) WHERE fair_key IS NOT NULL;
-- The heartbeat asks which of its claims have a cancellation pending (newest wins, 0015).
CREATE INDEX keyed_claims_cancel_idx ON keyed_claims (holder) WHERE cancel_requested_at IS NOT NULL;
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
    debounce_key text,
    debounce_cap timestamptz,
    PRIMARY KEY (task_id, attempt),
    CONSTRAINT keyed_waiting_waits_for_something CHECK (key IS NOT NULL OR group_key IS NOT NULL),
    CONSTRAINT keyed_waiting_group_seq_with_group CHECK ((group_key IS NULL) = (group_seq IS NULL)),
    CONSTRAINT keyed_waiting_cost_positive CHECK (cost >= 1),
    CONSTRAINT keyed_waiting_keys_with_key CHECK (keys IS NULL OR key IS NOT NULL),
    CONSTRAINT keyed_waiting_reserved_shards_match CHECK (
        cardinality(reserved_keys) IS NOT DISTINCT FROM cardinality(reserved_shards)),
    CONSTRAINT keyed_waiting_reserved_when CHECK ((reserved_keys IS NULL) = (reserved_at IS NULL)),
    -- a debounced row (0011) has both: its burst's identity in its line and its latest due time
    CONSTRAINT keyed_waiting_debounce_pair CHECK ((debounce_key IS NULL) = (debounce_cap IS NULL)),
    -- the weight the parked call carries (task option / header fair_weight, 0016); NULL: none
    fair_weight double precision,
    CONSTRAINT keyed_waiting_fair_weight_positive CHECK (fair_weight > 0)
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
CREATE INDEX keyed_waiting_debounce_idx ON keyed_waiting (key, debounce_key) WHERE debounce_key IS NOT NULL;
-- The sweep's reads of rare rows (0017): orphan shadows, and attempts with several keys in promotion order.
CREATE INDEX keyed_waiting_shadow_idx ON keyed_waiting (task_id, attempt) WHERE shadow;
CREATE INDEX keyed_waiting_multi_idx ON keyed_waiting (priority DESC, arrival)
    WHERE keys IS NOT NULL AND NOT shadow AND not_before IS NULL AND NOT group_blocked;

-- Groups: one row per group_key, the lock of the group's admission and its sequence counter (D10).
CREATE TABLE keyed_groups (
    group_key text PRIMARY KEY,
    next_seq bigint NOT NULL DEFAULT 1,
    -- a held group (0027, group_failure 'hold'): since when, the head whose failure held it, why; nothing of the
    -- group starts until an operator resumes it or skips its head
    held_since timestamptz,
    held_task_id text,
    held_reason text,
    CONSTRAINT keyed_groups_hold_whole
        CHECK ((held_since IS NULL) = (held_task_id IS NULL) AND (held_since IS NULL) = (held_reason IS NULL))
);
CREATE INDEX keyed_groups_held_idx ON keyed_groups (held_since) WHERE held_since IS NOT NULL;
COMMENT ON TABLE keyed_groups IS
    'Ordered groups: the next number to register and, for a group of a name whose group_failure is hold, the hold '
    'since its head failed (resume: celery keyed resume-group; skip the head: celery keyed skip-group-head).';

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

-- keyed_group_failure: the failure policy of a group key's name ('halt' when the name has no row).
CREATE FUNCTION keyed_group_failure(p_group_key text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT COALESCE((SELECT n.group_failure FROM keyed_names n WHERE n.name = split_part(p_group_key, ':', 1)), 'halt')
$$;

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
-- Read inside every claim statement, so a new override takes effect at the next claim with no cache (PL/pgSQL keeps
-- the plans of its two lookups for the session, not their answers; as a SQL function with sub-selects it could not
-- be inlined and was planned again at every call: 0.15-0.18 ms against 0.04, about five calls per release).
CREATE FUNCTION keyed_effective_limit(p_name text, p_now timestamptz) RETURNS integer
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

-- The weight of fair key p_fair_key of name p_name, whose head carries p_task_weight (NULL: none), 0016: a live
-- override (longest matching prefix), else the call's weight, else the name's table (longest matching prefix), else
-- 1. A prefix matches a fair key equal to it or starting with it and ':' ("tenant" matches "tenant:7"; "tenant:big"
-- matches "tenant:big" and "tenant:big:eu", never "tenant:bigger"). PL/pgSQL like keyed_effective_limit: called once per
-- waiting fair key at every promotion of a fair line, its lookups keep their plans for the session.
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
CREATE FUNCTION keyed_key_limit(p_key text, p_now timestamptz) RETURNS integer
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

-- Shards of a name (1 unless configured). PL/pgSQL for the same reason.
CREATE FUNCTION keyed_name_shards(p_name text) RETURNS integer
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_shards integer;
BEGIN
    SELECT c.shards INTO v_shards FROM keyed_names c WHERE c.name = p_name;
    RETURN COALESCE(v_shards, 1);
END
$$;

-- The share of shard p_shard when p_limit slots are split over p_shards shards: shares sum to p_limit (D12);
-- a shard beyond the current count (after shards were lowered) has share 0 and only drains.
CREATE FUNCTION keyed_shard_share(p_limit integer, p_shards integer, p_shard integer) RETURNS integer
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN p_shard >= p_shards THEN 0
                ELSE p_limit / p_shards + CASE WHEN p_shard < p_limit % p_shards THEN 1 ELSE 0 END END
$$;

-- The share of shard p_shard of key p_key now: keyed_shard_share(keyed_key_limit(p_key, p_now), p_shards, p_shard).
-- No guard of this version calls it since 0024 (keyed_row_share, which follows the rows' layout, replaced it): it is
-- kept for the statements of workers from before 0024 during a rolling deploy.
-- VOLATILE like keyed_key_limit, for the same reason (a guard re-checked after a lock wait reads the newest
-- override). One PL/pgSQL function, not the SQL keyed_shard_share around keyed_key_limit: a SQL function whose
-- argument is a volatile call is not inlined and is set up again at every statement that calls it (about 0.1 ms
-- per claim, 0018).
CREATE FUNCTION keyed_key_share(p_key text, p_now timestamptz, p_shards integer, p_shard integer) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_limit integer := keyed_key_limit(p_key, p_now);
BEGIN
    IF p_shard >= p_shards THEN
        RETURN 0;
    END IF;
    RETURN v_limit / p_shards + CASE WHEN p_shard < v_limit % p_shards THEN 1 ELSE 0 END;
END
$$;

-- The share of slot row p_shard of key p_key now, for a row laid out for p_layout shards (keyed_slots.shards) while
-- the name is configured for p_target: the smaller of the row's share in the two layouts, so that the shares of a
-- key's rows never sum above its limit while its rows still follow an older shard count, and a row beyond either
-- count only drains. Every row of a key carry one layout (keyed_slots_ensure, keyed_reshard); a holding taken
-- under a layout fits that layout, and the key moves to the configured count only once every holding fits it
-- (keyed_reshard): no change of shards can let a row admit past the bound (D18). VOLATILE like keyed_key_limit.
CREATE FUNCTION keyed_row_share(p_key text, p_now timestamptz, p_layout integer, p_target integer, p_shard integer)
RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_limit integer;
BEGIN
    IF p_shard >= p_layout OR p_shard >= p_target THEN
        RETURN 0;
    END IF;
    v_limit := keyed_key_limit(p_key, p_now);
    RETURN LEAST(v_limit / p_layout + CASE WHEN p_shard < v_limit % p_layout THEN 1 ELSE 0 END,
                 v_limit / p_target + CASE WHEN p_shard < v_limit % p_target THEN 1 ELSE 0 END);
END
$$;

-- keyed_slots_ensure: create the missing slot rows of a key and answer its layout. Row 0 is the anchor: it is
-- created first, for the name's current shard count, and locked; the other rows are created for row 0's layout
-- under that lock, so a key's rows never mix two layouts (keyed_reshard changes a layout under every row's lock).
-- Lock order: row 0 first, as every path that locks a key's rows in shard order.
CREATE FUNCTION keyed_slots_ensure(p_key text, p_name text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_layout integer;
BEGIN
    FOR i IN 1 .. 5 LOOP  -- row 0 can be dropped as idle between the insert and the lock: insert it again
        INSERT INTO keyed_slots (key, shard, name, used, shards)
        VALUES (p_key, 0, p_name, 0, keyed_name_shards(p_name))
        ON CONFLICT (key, shard) DO NOTHING;
        SELECT s.shards INTO v_layout FROM keyed_slots s WHERE s.key = p_key AND s.shard = 0 FOR UPDATE;
        EXIT WHEN v_layout IS NOT NULL;
    END LOOP;
    INSERT INTO keyed_slots (key, shard, name, used, shards)
    SELECT p_key, g, p_name, 0, v_layout FROM generate_series(1, v_layout - 1) AS g
    ON CONFLICT (key, shard) DO NOTHING;
    RETURN v_layout;
END
$$;

-- keyed_reshard: move a key's slot rows to its name's current shard count, if every holding fits the new layout
-- (a row beyond the new count holds nothing; every other row holds at most its new share; an exclusive holding never
-- fits a change). Locks every row of the key in shard order (callers hold them already). Answers whether it moved.
-- Until it moves, keyed_row_share gives each row the smaller of its two shares, so the key drains toward the new
-- layout; slots.slots_lock_all (the slow path and the promotion of a key) and reconcile call this.
CREATE FUNCTION keyed_reshard(p_key text, p_now timestamptz) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_name text;
    v_target integer;
    v_limit integer;
    v_layout integer;
    r record;
BEGIN
    FOR r IN SELECT s.shard, s.used, s.shards, s.name FROM keyed_slots s WHERE s.key = p_key ORDER BY s.shard
               FOR UPDATE
    LOOP
        IF v_layout IS NULL THEN
            v_layout := r.shards;
            v_name := r.name;
            v_target := keyed_name_shards(r.name);
            EXIT WHEN v_layout = v_target;
            v_limit := keyed_key_limit(p_key, COALESCE(p_now, now()));
        END IF;
        IF r.used > 0 AND (r.shard >= v_target OR r.used > keyed_shard_share(v_limit, v_target, r.shard)) THEN
            RETURN false;
        END IF;
    END LOOP;
    IF v_layout IS NULL OR v_layout = v_target THEN
        RETURN false;
    END IF;
    DELETE FROM keyed_slots s WHERE s.key = p_key AND s.shard >= v_target;
    UPDATE keyed_slots s SET shards = v_target WHERE s.key = p_key;
    INSERT INTO keyed_slots (key, shard, name, used, shards)
    SELECT p_key, g, v_name, 0, v_target FROM generate_series(0, v_target - 1) AS g
    ON CONFLICT (key, shard) DO NOTHING;
    RETURN true;
END
$$;

-- Server-side paths (migration 0005): batches of claims and releases, and the hot path's multi-statement
-- transactions as one function call each; the lock order and every guard of the statements they replace are kept
-- inside them (docs/ledger.md: Server-side paths).

-- keyed_claim_many: the fast claim of a batch of arrivals, each with one key, no group, no not-before, on a name
-- without a rate: one call. One row per input position (ord, 1-based): new = this call recorded the task's first
-- arrival; fence and shard when admitted. Not admitted (fence NULL): no room seen, a later attempt or a known task
-- (D8 is checked by the general path), expired, the first use of a key of a sharded name (no slot rows yet; a
-- single-shard name's key gets its rows here), a rated name, or a row of a
-- key behind a row of that key that was not admitted (FIFO within a key, D10: a batch never lets a later arrival
-- pass an earlier one). The caller admits those one by one, in input order.
-- Locks: every task row first, in task id order; then the slot rows key by key in key order (a name with one shard
-- waits for its row like any counter update; a sharded name picks with SKIP LOCKED, never waiting), so two batches
-- never wait on each other in a cycle; then the claims taken are inserted, in one statement (migration 0006: new
-- rows of task ids whose rows this call holds). The bound (D1) is the same guarded pick-and-take as fast_paths.CLAIM_NEW:
-- used + cost <= keyed_row_share(...) under the row's lock, and never ahead of a
-- promotable waiter (the room belongs to the head of the line, D10).
CREATE FUNCTION keyed_claim_many(
    p_task_ids text[], p_attempts integer[], p_task_names text[], p_keys text[], p_deadlines timestamptz[],
    p_costs integer[], p_fair_keys text[], p_holder text, p_lease double precision, p_now timestamptz)
RETURNS TABLE (ord integer, new boolean, fence bigint, shard integer)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := COALESCE(p_now, now());
    v_inserted text[];
    v_new boolean;
    r record;
    v_key text := NULL;
    v_name text := NULL;
    v_blocked boolean := false;
    v_shards integer;
    v_rated boolean;
    v_shard integer;
    v_fence bigint;
    -- the claims this call takes, written by one INSERT after the loop (c_*: one element per claim)
    c_task_ids text[] := '{}';
    c_attempts integer[] := '{}';
    c_keys text[] := '{}';
    c_shards integer[] := '{}';
    c_fences bigint[] := '{}';
    c_costs integer[] := '{}';
    c_fair_keys text[] := '{}';
BEGIN
    -- The books: one row per task id, inserted or locked in task id order (its first position's name and key); new
    -- only for the first position of a task id in the batch (a second delivery in the same batch is a known task).
    WITH ins AS (
        INSERT INTO keyed_tasks AS kt (task_id, task_name, key, group_key, arrived_at)
        SELECT DISTINCT ON (t.task_id) t.task_id, t.task_name, t.key, NULL, v_now
          FROM unnest(p_task_ids, p_task_names, p_keys) WITH ORDINALITY AS t(task_id, task_name, key, ord)
         ORDER BY t.task_id, t.ord
        ON CONFLICT (task_id) DO UPDATE SET task_id = excluded.task_id
        RETURNING kt.task_id, (kt.xmax = 0) AS new
    )
    SELECT COALESCE(array_agg(ins.task_id) FILTER (WHERE ins.new), '{}') INTO v_inserted FROM ins;

    FOR r IN
        SELECT t.key, t.ord::integer AS ord, t.task_id, t.attempt, t.deadline, t.cost, t.fair_key
          FROM unnest(p_keys, p_task_ids, p_attempts, p_deadlines, p_costs, p_fair_keys)
               WITH ORDINALITY AS t(key, task_id, attempt, deadline, cost, fair_key, ord)
         ORDER BY t.key, t.ord
    LOOP
        IF r.key IS DISTINCT FROM v_key THEN
            v_key := r.key;
            v_blocked := false;
            -- The name's shards and rate, read once per name in a call (the keys come sorted: a name's keys are
            -- mostly together).
            IF split_part(r.key, ':', 1) IS DISTINCT FROM v_name THEN
                v_name := split_part(r.key, ':', 1);
                SELECT keyed_name_shards(v_name),
                       COALESCE((SELECT c.rated FROM keyed_names c WHERE c.name = v_name), false)
                  INTO v_shards, v_rated;
            END IF;
        END IF;
        v_shard := NULL;
        v_fence := NULL;
        v_new := r.task_id = ANY(v_inserted) AND array_position(p_task_ids, r.task_id) = r.ord;
        IF NOT v_blocked AND v_new AND NOT v_rated AND (r.deadline IS NULL OR r.deadline > v_now) THEN
            IF v_shards = 1 THEN
                -- One row: the guarded UPDATE is the claim (D1, D2), its share read once. It takes the row's lock
                -- only when the guard holds, and READ COMMITTED re-evaluates the guard (a fresh share) on the row's
                -- newest version after waiting for that lock. A key whose rows still follow another shard count
                -- (before the sweep moves them) is tried on its row 0 only; refused, it takes the general path.
                FOR v_try IN 1 .. 2 LOOP
                    UPDATE keyed_slots s SET used = s.used + r.cost
                     WHERE s.key = r.key AND s.shard = 0
                       AND s.used + r.cost <= keyed_row_share(r.key, v_now, s.shards, v_shards, s.shard)
                       AND NOT EXISTS (
                           SELECT 1 FROM keyed_waiting w
                            WHERE w.key = r.key AND NOT w.shadow AND (w.not_before IS NULL OR w.not_before <= v_now)
                              AND NOT w.group_blocked AND (w.deadline IS NULL OR w.deadline > v_now))
                    RETURNING s.shard INTO v_shard;
                    EXIT WHEN v_shard IS NOT NULL OR v_try = 2
                              OR EXISTS (SELECT 1 FROM keyed_slots s WHERE s.key = r.key);
                    -- The key's first use (migration 0006): its slot row and its head row are created as
                    -- keyed_admit_or_park_plain creates them (keyed_slots_ensure: row 0 of the name's layout, locked;
                    -- then the head row), and the same guarded UPDATE takes the slot. Lock order as for any key:
                    -- its slot rows, then its head row, before the next key's.
                    PERFORM keyed_slots_ensure(r.key, v_name);
                    INSERT INTO keyed_keys AS k (key, name, waiting, active_at) VALUES (r.key, v_name, 0, v_now)
                    ON CONFLICT (key) DO UPDATE SET active_at = excluded.active_at;
                END LOOP;
            ELSE
                SELECT s.shard INTO v_shard FROM keyed_slots s
                 WHERE s.key = r.key AND s.used + r.cost <= keyed_row_share(r.key, v_now, s.shards, v_shards, s.shard)
                   AND NOT EXISTS (
                       SELECT 1 FROM keyed_waiting w
                        WHERE w.key = r.key AND NOT w.shadow AND (w.not_before IS NULL OR w.not_before <= v_now)
                          AND NOT w.group_blocked AND (w.deadline IS NULL OR w.deadline > v_now))
                 ORDER BY random() LIMIT 1
                   FOR UPDATE OF s SKIP LOCKED;
                IF v_shard IS NOT NULL THEN
                    -- The guard again under the lock: the bound holds even if the limit changed (D1).
                    UPDATE keyed_slots s SET used = s.used + r.cost
                     WHERE s.key = r.key AND s.shard = v_shard
                       AND s.used + r.cost <= keyed_row_share(r.key, v_now, s.shards, v_shards, s.shard)
                    RETURNING s.shard INTO v_shard;
                END IF;
            END IF;
            IF v_shard IS NOT NULL THEN
                -- The slot is taken: the claim is this call's (its row is written with the others, below).
                v_fence := nextval('keyed_fence_seq');
                c_task_ids := c_task_ids || r.task_id; c_attempts := c_attempts || r.attempt;
                c_keys := c_keys || r.key; c_shards := c_shards || v_shard; c_fences := c_fences || v_fence;
                c_costs := c_costs || r.cost; c_fair_keys := c_fair_keys || r.fair_key;
            END IF;
        END IF;
        IF v_fence IS NULL THEN
            v_blocked := true;  -- FIFO within the key: the rows of this key behind it wait for the caller
        END IF;
        ord := r.ord;
        new := v_new;
        fence := v_fence;
        shard := v_shard;
        RETURN NEXT;
    END LOOP;
    -- Every claim taken, in one statement: the table's checks are set up once per statement, not once per claim
    -- (they were half of a claim row's cost), and the failover guard asks once. The answers above are returned only
    -- when this succeeds: an error here (the guard after a failover) rolls back the whole call, slots included.
    IF cardinality(c_task_ids) > 0 THEN
        INSERT INTO keyed_claims (task_id, attempt, key, shard, group_key, state, fence, holder, lease_expires_at,
                                  claimed_at, cost, fair_key)
        SELECT c.task_id, c.attempt, c.key, c.shard, NULL, 'running', c.fence, p_holder,
               v_now + make_interval(secs => p_lease), v_now, c.cost, c.fair_key
          FROM unnest(c_task_ids, c_attempts, c_keys, c_shards, c_fences, c_costs, c_fair_keys)
               AS c(task_id, attempt, key, shard, fence, cost, fair_key);
    END IF;
END
$$;

-- keyed_release_many: the release of a batch of claims without a group, with the waiter check (D2), in one call.
-- One row per input position: released = this call deleted the claim (only the owner of this exact fence gets the
-- row: release exactly once); recorded = the task's final outcome was recorded now; has_shadow = a duplicate waits
-- as the shadow of the attempt (D8: the caller lets it follow); key = its first key; room_keys / room_shards /
-- room_free: the (key, shard) rows it gave slots back to that now have room AND whose key has parked attempts, read
-- after the slot rows were locked and given back (a later statement, a new snapshot: D2), each row reported once,
-- at the first position that gave back a slot on that key. p_finals[i] NULL: the attempt is over but the task goes
-- on (retry). Claims with a group, promoted or uncertain are not released here (released = false).
-- Locks: the claim rows and their task rows, token by token in (task id, attempt) order (the order of
-- fast_paths.RELEASE_FAST for one: claim, then its task), then every slot row in (key, shard) order.
CREATE FUNCTION keyed_release_many(
    p_task_ids text[], p_attempts integer[], p_fences bigint[], p_finals text[], p_details text[], p_now timestamptz)
RETURNS TABLE (ord integer, released boolean, recorded boolean, has_shadow boolean, key text,
               room_keys text[], room_shards integer[], room_free integer[])
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := COALESCE(p_now, now());
    n integer := COALESCE(cardinality(p_task_ids), 0);
    r record;
    c record;
    g record;
    v_released boolean[] := array_fill(false, ARRAY[n]);
    v_recorded boolean[] := array_fill(false, ARRAY[n]);
    v_first text[] := array_fill(NULL::text, ARRAY[n]);
    h_ord integer[] := '{}';
    h_key text[] := '{}';
    h_shard integer[] := '{}';
    h_cost integer[] := '{}';
    w_ord integer[] := '{}';
    w_key text[] := '{}';
    w_shard integer[] := '{}';
    r_ord integer[] := '{}';
    r_key text[] := '{}';
    r_shard integer[] := '{}';
    r_free integer[] := '{}';
    v_key text;
    v_waits boolean;
    v_free integer;
    v_rows integer;
BEGIN
    FOR r IN
        SELECT t.ord::integer AS ord, t.task_id, t.attempt, t.fence, t.final, t.detail
          FROM unnest(p_task_ids, p_attempts, p_fences, p_finals, p_details)
               WITH ORDINALITY AS t(task_id, attempt, fence, final, detail, ord)
         ORDER BY t.task_id, t.attempt, t.ord
    LOOP
        -- Release exactly once (§3.4): only the owner of this exact fence deletes the running claim.
        DELETE FROM keyed_claims k
         WHERE k.task_id = r.task_id AND k.attempt = r.attempt AND k.fence = r.fence AND k.state = 'running'
           AND k.group_key IS NULL
        RETURNING k.key, k.shard, k.cost, k.extra_keys, k.extra_shards INTO c;
        IF NOT FOUND THEN
            CONTINUE;  -- nothing to release (stale fence, second call, reaped), or a claim the general path takes
        END IF;
        v_released[r.ord] := true;
        v_first[r.ord] := c.key;
        -- The books: the task's one final outcome (guarded: outcome IS NULL), or the attempt is over (retry).
        UPDATE keyed_tasks t
           SET outcome = COALESCE(t.outcome, r.final),
               finished_at = COALESCE(t.finished_at, CASE WHEN r.final IS NOT NULL THEN v_now END),
               detail = CASE WHEN t.outcome IS NULL AND r.final IS NOT NULL THEN r.detail ELSE t.detail END,
               finished_attempt = GREATEST(t.finished_attempt, r.attempt)
         WHERE t.task_id = r.task_id AND (r.final IS NULL OR t.outcome IS NULL);
        GET DIAGNOSTICS v_rows = ROW_COUNT;
        v_recorded[r.ord] := r.final IS NOT NULL AND v_rows > 0;
        IF c.key IS NOT NULL THEN
            h_ord := h_ord || r.ord; h_key := h_key || c.key; h_shard := h_shard || c.shard; h_cost := h_cost || c.cost;
        END IF;
        IF c.extra_keys IS NOT NULL THEN
            h_ord := h_ord || array_fill(r.ord, ARRAY[cardinality(c.extra_keys)]);
            h_key := h_key || c.extra_keys;
            h_shard := h_shard || c.extra_shards;
            h_cost := h_cost || array_fill(c.cost, ARRAY[cardinality(c.extra_keys)]);
        END IF;
    END LOOP;

    -- Give every slot back to the shard it came from, one row at a time by primary key in (key, shard) order (the
    -- lock order: each UPDATE takes its row's lock). Row by row, never a join against the pairs: this function's
    -- plans are generic (0013), and a generic plan of such a join scans the whole of keyed_slots (0018).
    FOR g IN
        SELECT x.key, x.shard, sum(x.cost)::integer AS cost, min(min(x.ord)) OVER (PARTITION BY x.key) AS ord
          FROM unnest(h_ord, h_key, h_shard, h_cost) AS x(ord, key, shard, cost)
         GROUP BY x.key, x.shard
         ORDER BY x.key, x.shard
    LOOP
        UPDATE keyed_slots sl SET used = sl.used - g.cost WHERE sl.key = g.key AND sl.shard = g.shard;
        w_ord := w_ord || g.ord; w_key := w_key || g.key; w_shard := w_shard || g.shard;
    END LOOP;
    -- Who waits, read now: after every slot row's lock (a later statement, a new snapshot: an attempt parked by a
    -- transaction that held one before us is seen, D2). Where a key has parked attempts, each of its rows with room
    -- is reported at the first position that gave back a slot on that key. Without waiters (the common case) no
    -- room is reported and no limit is read.
    FOR i IN 1 .. cardinality(w_key) LOOP
        IF w_key[i] IS DISTINCT FROM v_key THEN
            v_key := w_key[i];
            v_waits := EXISTS (SELECT 1 FROM keyed_keys k WHERE k.key = v_key AND k.waiting > 0);
        END IF;
        CONTINUE WHEN NOT v_waits;
        SELECT GREATEST(keyed_row_share(sl.key, v_now, sl.shards, keyed_name_shards(sl.name), sl.shard)
                        - sl.used, 0)
          INTO v_free
          FROM keyed_slots sl WHERE sl.key = v_key AND sl.shard = w_shard[i];
        IF v_free > 0 THEN
            r_ord := r_ord || w_ord[i]; r_key := r_key || v_key; r_shard := r_shard || w_shard[i];
            r_free := r_free || v_free;
        END IF;
    END LOOP;
    RETURN QUERY
    SELECT i::integer, v_released[i], v_recorded[i],
           v_released[i] AND EXISTS (
               SELECT 1 FROM keyed_waiting w WHERE w.task_id = p_task_ids[i] AND w.attempt = p_attempts[i] AND w.shadow),
           v_first[i],
           ARRAY(SELECT x.key FROM unnest(r_ord, r_key) AS x(ord, key) WHERE x.ord = i),
           ARRAY(SELECT x.shard FROM unnest(r_ord, r_shard) AS x(ord, shard) WHERE x.ord = i),
           ARRAY(SELECT x.free FROM unnest(r_ord, r_free) AS x(ord, free) WHERE x.ord = i)
      FROM generate_series(1, n) AS i;
END
$$;
-- keyed_release_many runs with generic plans (0013): every statement in it reaches rows by primary key or by the
-- (key, shard) pairs it was given, where a custom plan is never better, and planning each of them again at every
-- call (the default for parameterised statements whose generic plan is not cheaper by estimate) was most of its
-- server time: 1.4-1.7 ms of self time per call against 0.5-0.7 ms (one client, durable PostgreSQL).
ALTER FUNCTION keyed_release_many(text[], integer[], bigint[], text[], text[], timestamptz)
    SET plan_cache_mode = force_generic_plan;

-- keyed_promote_plain: give the free slots of the (key, shard) rows p_keys[i] / p_shards[i] to the next waiters of
-- their keys, key by key in key order, each line in its order (priority, then arrival: D10), as long as its head is
-- plain — one key, no group, no reservation, shared (not exclusive: migration 0012), on a name that is neither
-- fair nor rated. At the first head that is not plain the key's line stops and one row with task_id NULL names
-- the key: the caller promotes the rest of that line (promote.promote_waiters), in the same transaction. A head
-- that needs more slots than any of the given shards has free stops its line (the room stays for it).
-- Locks (lock order): every given slot row in (key, shard) order (a caller that holds them already holds them), then
-- the keys' head rows in key order. Each promotion takes its slot with the guarded UPDATE (D1), moves the waiting
-- row into a claim with a fresh nonce (D5) — or, for a releaser that runs it itself (p_local_holder set, its queue
-- and task listed: D4), into a running claim of that releaser, at most p_local_max of them — and counts it out of
-- the waiting room.
CREATE FUNCTION keyed_promote_plain(
    p_keys text[], p_shards integer[], p_dispatch double precision, p_now timestamptz, p_local_holder text,
    p_local_lease double precision, p_local_queues text[], p_local_tasks text[], p_local_max integer)
RETURNS TABLE (key text, task_id text, attempt integer, nonce uuid, fence bigint, shard integer, queue text,
               message jsonb)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := COALESCE(p_now, now());
    v_key text;
    v_name text;
    v_shards integer[];
    v_budget integer;
    v_fair boolean;
    v_rated boolean;
    v_shard integer;
    v_fence bigint;
    v_nonce uuid;
    v_parked jsonb;
    v_local integer := CASE WHEN p_local_holder IS NULL THEN 0 ELSE COALESCE(p_local_max, 1) END;
    w record;
BEGIN
    -- The freed slot rows, locked in (key, shard) order, each by its primary key (0021).
    FOR v_key, v_shard IN
        SELECT DISTINCT x.key, x.shard FROM unnest(p_keys, p_shards) AS x(key, shard) ORDER BY 1, 2
    LOOP
        PERFORM 1 FROM keyed_slots s WHERE s.key = v_key AND s.shard = v_shard FOR UPDATE;
    END LOOP;
    FOR v_key, v_shards IN
        SELECT x.key, array_agg(DISTINCT x.shard) FROM unnest(p_keys, p_shards) AS x(key, shard)
         GROUP BY x.key ORDER BY x.key
    LOOP
        v_name := split_part(v_key, ':', 1);
        SELECT COALESCE(sum(GREATEST(keyed_row_share(v_key, v_now, s.shards,
                                                       keyed_name_shards(v_name), s.shard) - s.used, 0)), 0)
          INTO v_budget
          FROM keyed_slots s WHERE s.key = v_key AND s.shard = ANY(v_shards);
        CONTINUE WHEN v_budget = 0;
        PERFORM 1 FROM keyed_keys k WHERE k.key = v_key FOR UPDATE;
        -- Rows whose not-before time passed join the line first (their arrival number keeps their place, D2).
        UPDATE keyed_waiting wt SET not_before = NULL WHERE wt.key = v_key AND wt.not_before <= v_now;
        SELECT COALESCE(c.fair, false), COALESCE(c.rated, false) INTO v_fair, v_rated
          FROM (SELECT 1) one LEFT JOIN keyed_names c ON c.name = v_name;
        WHILE v_budget > 0 LOOP
            SELECT wt.task_id, wt.attempt, wt.group_key, wt.keys, wt.reserved_keys, wt.cost, wt.queue, wt.message,
                   wt.fair_key
              INTO w
              FROM keyed_waiting wt
             WHERE wt.key = v_key AND NOT wt.shadow AND wt.not_before IS NULL AND NOT wt.group_blocked
               AND (wt.deadline IS NULL OR wt.deadline > v_now)
             ORDER BY wt.priority DESC, wt.arrival
             LIMIT 1
               FOR UPDATE SKIP LOCKED;
            EXIT WHEN NOT FOUND;
            IF v_fair OR v_rated OR w.group_key IS NOT NULL OR w.keys IS NOT NULL OR w.reserved_keys IS NOT NULL
               OR w.cost >= 1073741824 THEN
                key := v_key; task_id := NULL; attempt := NULL; nonce := NULL; fence := NULL; shard := NULL;
                queue := NULL; message := NULL;
                RETURN NEXT;  -- not plain: the caller promotes the rest of this line
                EXIT;
            END IF;
            v_shard := NULL;
            UPDATE keyed_slots s SET used = s.used + w.cost
             WHERE (s.key, s.shard) = (
                    SELECT s2.key, s2.shard FROM keyed_slots s2
                     WHERE s2.key = v_key AND s2.shard = ANY(v_shards)
                       AND s2.used + w.cost <= keyed_row_share(v_key, v_now, s2.shards,
                                                                 keyed_name_shards(v_name), s2.shard)
                     ORDER BY s2.shard LIMIT 1)
               AND s.used + w.cost <= keyed_row_share(v_key, v_now, s.shards,
                                                        keyed_name_shards(v_name), s.shard)
            RETURNING s.shard INTO v_shard;
            EXIT WHEN v_shard IS NULL;  -- the head of the line waits for room; the room is kept for it (D10)
            DELETE FROM keyed_waiting wt WHERE wt.task_id = w.task_id AND wt.attempt = w.attempt AND NOT wt.shadow
            RETURNING to_jsonb(wt.*) INTO v_parked;
            IF v_local > 0 AND w.queue = ANY(p_local_queues)
               AND jsonb_typeof(w.message) = 'object' AND (w.message ->> 'task') = ANY(p_local_tasks) THEN
                v_nonce := NULL;
                INSERT INTO keyed_claims (task_id, attempt, key, shard, group_key, state, fence, holder,
                                          lease_expires_at, claimed_at, parked, cost, fair_key)
                VALUES (w.task_id, w.attempt, v_key, v_shard, NULL, 'running', nextval('keyed_fence_seq'),
                        p_local_holder, v_now + make_interval(secs => p_local_lease), v_now, v_parked, w.cost,
                        w.fair_key)
                RETURNING keyed_claims.fence INTO v_fence;
                v_local := v_local - 1;  -- a releaser runs one promotion itself; the others are dispatched (D4/D5)
            ELSE
                v_nonce := gen_random_uuid();
                INSERT INTO keyed_claims (task_id, attempt, key, shard, group_key, state, fence, nonce,
                                          dispatch_deadline, lease_expires_at, claimed_at, parked, cost, fair_key)
                VALUES (w.task_id, w.attempt, v_key, v_shard, NULL, 'promoted', nextval('keyed_fence_seq'), v_nonce,
                        v_now + make_interval(secs => p_dispatch), v_now + make_interval(secs => p_dispatch), v_now,
                        v_parked, w.cost, w.fair_key)
                RETURNING keyed_claims.fence INTO v_fence;
            END IF;
            UPDATE keyed_keys k SET waiting = k.waiting - 1, active_at = v_now WHERE k.key = v_key;
            key := v_key; task_id := w.task_id; attempt := w.attempt; nonce := v_nonce; fence := v_fence;
            shard := v_shard; queue := w.queue; message := w.message;
            RETURN NEXT;
            v_budget := v_budget - 1;
        END LOOP;
    END LOOP;
END
$$;

-- keyed_release_and_promote: release a batch of claims without a group and give the rooms it frees to their keys'
-- next waiters, in one call and one transaction. It is keyed_release_many followed by keyed_promote_plain, unchanged,
-- so every guard and the lock order are theirs:
--   * release exactly once (DESIGN §3.4): a claim is given back only by the DELETE by token + fence + state
--     'running' + no group inside keyed_release_many (no row = nothing released);
--   * the books: one final outcome per task id (outcome IS NULL), inside keyed_release_many;
--   * lock order: claim and task rows token by token in (task id, attempt) order, then every slot row given back to
--     in (key, shard) order (keyed_release_many), then the head rows of the keys with waiters in key order
--     (keyed_promote_plain; the slot rows it locks again are held already);
--   * no lost wakeup (D2): who waits is read in a statement after the slot rows' locks were taken (a new snapshot:
--     an attempt parked by a transaction that held them before us is seen), and the promotion runs in the
--     transaction that made the room;
--   * the bound (D1): each promotion takes its slot with the guarded UPDATE used + cost <= share;
--   * FIFO (D10): each line in priority, then arrival order, while its head is plain (one key, no group, no
--     reservation, name neither fair nor rated); the first head that is not plain stops its line;
--   * admission token (D5) / local handoff (D4): a promotion gets a fresh nonce and a dispatch deadline, unless the
--     releasers run it themselves — every request that gave back a room with waiters names the same local set
--     (p_local_set[i], 0-based into p_local_sets: [{"queues": [...], "tasks": [...]}, ...]; NULL: none) and the
--     waiter's queue and task are in it: then it becomes a running claim of p_local_holder (no nonce), at most one
--     per such request.
-- Rows, in this order: kind 'release', one per input position (as keyed_release_many: ord, released, recorded,
-- has_shadow, key, and the (key, shard) rows it gave room on whose key has waiters — room_keys / room_shards, each at
-- the first position that gave back a slot on that key); then kind 'promotion', one per promoted attempt (key, task_id,
-- attempt, nonce, fence, shard, queue, message); then kind 'general' (key only) for a line whose head is not plain:
-- the caller promotes the rest of that line (promote.promote_waiters, in a transaction of its own: its room is
-- guarded meanwhile — arrivals never take a free slot while a promotable attempt waits, and the sweep promotes it if
-- the caller fails). Shadows (D8) are left to the caller too (has_shadow).
CREATE FUNCTION keyed_release_and_promote(
    p_task_ids text[], p_attempts integer[], p_fences bigint[], p_finals text[], p_details text[], p_now timestamptz,
    p_dispatch double precision, p_local_holder text, p_local_lease double precision, p_local_sets jsonb,
    p_local_set integer[])
RETURNS TABLE (kind text, ord integer, released boolean, recorded boolean, has_shadow boolean, key text,
               room_keys text[], room_shards integer[], task_id text, attempt integer, nonce uuid, fence bigint,
               shard integer, queue text, message jsonb)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    r record;
    v_keys text[] := '{}';
    v_shards integer[] := '{}';
    v_rooms integer := 0;
    v_set integer;
    v_one_set boolean := true;
    v_queues text[];
    v_tasks text[];
BEGIN
    -- The release and the waiter check (keyed_release_many: exactly once, the books, the give-back, D2).
    FOR r IN
        SELECT x.ord, x.released, x.recorded, x.has_shadow, x.key, x.room_keys, x.room_shards
          FROM keyed_release_many(p_task_ids, p_attempts, p_fences, p_finals, p_details, p_now) AS x
         ORDER BY x.ord
    LOOP
        kind := 'release'; ord := r.ord; released := r.released; recorded := r.recorded;
        has_shadow := r.has_shadow; key := r.key; room_keys := r.room_keys; room_shards := r.room_shards;
        task_id := NULL; attempt := NULL; nonce := NULL; fence := NULL; shard := NULL; queue := NULL;
        message := NULL;
        RETURN NEXT;
        IF cardinality(r.room_keys) > 0 THEN
            v_keys := v_keys || r.room_keys;
            v_shards := v_shards || r.room_shards;
            v_rooms := v_rooms + 1;
            -- Local handoff (D4) only when every request that gave back a room with waiters names the same set.
            IF v_rooms = 1 THEN
                v_set := p_local_set[r.ord];
            ELSIF v_set IS DISTINCT FROM p_local_set[r.ord] THEN
                v_one_set := false;
            END IF;
        END IF;
    END LOOP;
    IF v_rooms = 0 THEN
        RETURN;  -- nobody waits where room was made (the common case): the release alone
    END IF;
    IF v_one_set AND v_set IS NOT NULL THEN
        v_queues := ARRAY(SELECT jsonb_array_elements_text(p_local_sets -> v_set -> 'queues'));
        v_tasks := ARRAY(SELECT jsonb_array_elements_text(p_local_sets -> v_set -> 'tasks'));
    END IF;
    -- The promotion in the transaction that made the room (D2), each line FIFO (D10), the guarded take (D1), a nonce
    -- (D5) or a running claim of the releaser (D4, at most one per request with a room): keyed_promote_plain.
    FOR r IN
        SELECT x.key, x.task_id, x.attempt, x.nonce, x.fence, x.shard, x.queue, x.message
          FROM keyed_promote_plain(v_keys, v_shards, p_dispatch, p_now,
                                   CASE WHEN v_queues IS NULL THEN NULL ELSE p_local_holder END, p_local_lease,
                                   v_queues, v_tasks, v_rooms) AS x
    LOOP
        kind := CASE WHEN r.task_id IS NULL THEN 'general' ELSE 'promotion' END;
        ord := NULL; released := NULL; recorded := NULL; has_shadow := NULL; key := r.key; room_keys := NULL;
        room_shards := NULL; task_id := r.task_id; attempt := r.attempt; nonce := r.nonce; fence := r.fence;
        shard := r.shard; queue := r.queue; message := r.message;
        RETURN NEXT;
    END LOOP;
END
$$;

-- Whether a park-only decision (at receipt) leaves the arrival to its admission without writing anything: its key
-- has no line and has room (or is used for the first time). Read without locks (see keyed_admit_or_park_plain). A
-- function of its own (0021): inside keyed_admit_or_park_plain's IF, joined to p_park_only, it was planned again for
-- every call.
CREATE FUNCTION keyed_receipt_leaves_alone(p_key text, p_now timestamptz, p_shards integer)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    RETURN NOT EXISTS (
               SELECT 1 FROM keyed_waiting w
                WHERE w.key = p_key AND NOT w.shadow AND (w.not_before IS NULL OR w.not_before <= p_now)
                  AND NOT w.group_blocked AND (w.deadline IS NULL OR w.deadline > p_now))
           AND (EXISTS (
                    SELECT 1 FROM keyed_slots s
                     WHERE s.key = p_key
                       AND s.used + 1 <= keyed_row_share(p_key, p_now, s.shards, p_shards, s.shard))
                OR NOT EXISTS (SELECT 1 FROM keyed_slots s WHERE s.key = p_key));
END
$$;

-- keyed_admit_or_park_plain: admit-or-park of one plain arrival — one key, no group, no not-before, cost 1, no
-- supersede key, on a name without a rate — in one call (the general path's transaction, admit.admit, for that
-- case). Answers one row: verdict 'admitted' (fence, shard), 'parked', 'rejected' (its waiting room is full under
-- the policy 'reject'; the outcome is recorded) or 'general' when the general path must decide (a known attempt
-- token (D8), a task past its latest start, room next to a promotable waiter, a full room under 'supersede', a
-- group member); 'general' is answered before anything but the task's arrival was written.
-- p_park_only (the worker's park at receipt, docs/worker.md): the arrival is parked when its key has a line or no
-- room, exactly as above; where it would be admitted it is answered 'undecided' instead (no slot is ever taken:
-- D3, a slot is claimed only when a pool process can start the attempt).
-- Locks, in lock order: the task row; every slot row of the key in shard order (unconditionally, D2: a release
-- that gives a slot back either committed before — its room is seen — or sees this park); the key's head row.
CREATE FUNCTION keyed_admit_or_park_plain(
    p_task_id text, p_attempt integer, p_task_name text, p_key text, p_priority integer, p_deadline timestamptz,
    p_queue text, p_message jsonb, p_fair_key text, p_holder text, p_lease double precision, p_now timestamptz,
    p_park_only boolean)
RETURNS TABLE (verdict text, new boolean, fence bigint, shard integer, detail text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := COALESCE(p_now, now());
    v_name text := split_part(p_key, ':', 1);
    v_new boolean;
    v_outcome text;
    v_finished integer;
    v_shards integer := keyed_name_shards(split_part(p_key, ':', 1));
    v_limit integer;
    v_locked integer;
    v_layout integer;
    v_room integer;
    v_fence bigint;
    v_policy text;
BEGIN
    IF EXISTS (SELECT 1 FROM keyed_names c WHERE c.name = v_name AND c.rated) THEN
        RETURN QUERY SELECT 'general'::text, NULL::boolean, NULL::bigint, NULL::integer, ''::text;
        RETURN;
    END IF;
    IF p_park_only AND keyed_receipt_leaves_alone(p_key, v_now, v_shards) THEN
        -- Park only (at receipt): no line and room (or a key's first use), so the arrival is left to its admission when a pool process
        -- is ready for it (D3), and nothing is written. Read without locks: a wrong guess either way is harmless —
        -- a line that formed meanwhile is decided under the locks below (parked), a line that drained meanwhile is
        -- answered 'undecided' there too; a slot is never taken here.
        RETURN QUERY SELECT 'undecided'::text, NULL::boolean, NULL::bigint, NULL::integer, ''::text;
        RETURN;
    END IF;
    -- The books: record the arrival, or lock the task's row (two deliveries are admitted one after the other, D8).
    INSERT INTO keyed_tasks AS kt (task_id, task_name, key, group_key, arrived_at)
    VALUES (p_task_id, p_task_name, p_key, NULL, v_now)
    ON CONFLICT (task_id) DO UPDATE SET task_id = excluded.task_id
    RETURNING (kt.xmax = 0), kt.outcome, kt.finished_attempt INTO v_new, v_outcome, v_finished;
    -- A known task (a second delivery, a retry), an expired arrival or a group member: the general path. Asked one
    -- question at a time (0021): folded into one expression with v_new and p_deadline, the planner made a plan of its
    -- own for every call (a custom plan, cheaper once those values are constants), never keeping one.
    IF p_deadline <= v_now OR (NOT v_new AND (v_outcome IS NOT NULL OR v_finished >= p_attempt)) THEN
        RETURN QUERY SELECT 'general'::text, v_new, NULL::bigint, NULL::integer, ''::text;
        RETURN;
    END IF;
    IF NOT v_new THEN
        PERFORM 1 FROM keyed_claims k WHERE k.task_id = p_task_id AND k.attempt = p_attempt;
        IF NOT FOUND THEN
            PERFORM 1 FROM keyed_waiting w WHERE w.task_id = p_task_id AND w.attempt = p_attempt;
        END IF;
        IF FOUND THEN
            RETURN QUERY SELECT 'general'::text, v_new, NULL::bigint, NULL::integer, ''::text;
            RETURN;
        END IF;
    END IF;
    PERFORM 1 FROM keyed_group_members m WHERE m.task_id = p_task_id;
    IF FOUND THEN
        RETURN QUERY SELECT 'general'::text, v_new, NULL::bigint, NULL::integer, ''::text;
        RETURN;
    END IF;
    -- Every slot row of the key, created on first use (keyed_slots_ensure: the key's own layout), locked in shard
    -- order.
    SELECT count(*), min(s.shards) INTO v_locked, v_layout FROM (
        SELECT s.shards FROM keyed_slots s WHERE s.key = p_key ORDER BY s.shard FOR UPDATE) s;
    IF v_locked = 0 OR v_locked < v_layout THEN
        PERFORM keyed_slots_ensure(p_key, v_name);
        PERFORM 1 FROM keyed_slots s WHERE s.key = p_key ORDER BY s.shard FOR UPDATE;
    END IF;
    INSERT INTO keyed_keys (key, name, waiting, active_at) VALUES (p_key, v_name, 0, v_now)
    ON CONFLICT (key) DO UPDATE SET active_at = excluded.active_at;
    v_limit := keyed_key_limit(p_key, v_now);
    SELECT s.shard INTO v_room FROM keyed_slots s
     WHERE s.key = p_key AND s.used + 1 <= LEAST(keyed_shard_share(v_limit, s.shards, s.shard), keyed_shard_share(v_limit, v_shards, s.shard))
     ORDER BY s.shard LIMIT 1;
    IF EXISTS (SELECT 1 FROM keyed_waiting w
                WHERE w.key = p_key AND NOT w.shadow AND (w.not_before IS NULL OR w.not_before <= v_now)
                  AND NOT w.group_blocked AND (w.deadline IS NULL OR w.deadline > v_now)) THEN
        IF v_room IS NOT NULL THEN
            -- Room with a line in front of it: the general path starts the line's head first (admit.admit).
            RETURN QUERY SELECT 'general'::text, v_new, NULL::bigint, NULL::integer, ''::text;
            RETURN;
        END IF;
    ELSIF v_room IS NOT NULL AND p_park_only THEN
        -- Park only: room and no line under the locks; the arrival is admitted later, when a pool process is
        -- ready (D3). Its arrival is recorded (a later admission sees a known task with no claim and no waiting
        -- row: the ordinary path).
        RETURN QUERY SELECT 'undecided'::text, v_new, NULL::bigint, NULL::integer, ''::text;
        RETURN;
    ELSIF v_room IS NOT NULL THEN
        -- The bound (D1): the guarded take under the row's lock.
        UPDATE keyed_slots s SET used = s.used + 1
         WHERE s.key = p_key AND s.shard = v_room AND s.used + 1 <= LEAST(keyed_shard_share(v_limit, s.shards, s.shard), keyed_shard_share(v_limit, v_shards, s.shard))
        RETURNING s.shard INTO v_room;
        IF v_room IS NOT NULL THEN
            INSERT INTO keyed_claims (task_id, attempt, key, shard, group_key, state, fence, holder,
                                      lease_expires_at, claimed_at, cost, fair_key)
            VALUES (p_task_id, p_attempt, p_key, v_room, NULL, 'running', nextval('keyed_fence_seq'), p_holder,
                    v_now + make_interval(secs => p_lease), v_now, 1, p_fair_key)
            RETURNING keyed_claims.fence INTO v_fence;
            RETURN QUERY SELECT 'admitted'::text, v_new, v_fence, v_room, ''::text;
            RETURN;
        END IF;
    END IF;
    -- Park: a place in the waiting room (max_waiting, the guarded increment of keys.KEYS_ADD_WAITING).
    UPDATE keyed_keys k SET waiting = k.waiting + 1
     WHERE k.key = p_key
       AND k.waiting < COALESCE((SELECT c.max_waiting FROM keyed_names c WHERE c.name = v_name), 2147483647);
    IF NOT FOUND THEN
        SELECT c.overflow INTO v_policy FROM keyed_names c WHERE c.name = v_name;
        IF v_policy = 'supersede' THEN
            RETURN QUERY SELECT 'general'::text, v_new, NULL::bigint, NULL::integer, ''::text;
            RETURN;
        END IF;
        -- The one final outcome (books.BOOKS_FINISH: outcome IS NULL).
        UPDATE keyed_tasks t SET outcome = 'rejected', finished_at = v_now,
               detail = 'waiting room of ' || p_key || ' is full', finished_attempt = GREATEST(t.finished_attempt, p_attempt)
         WHERE t.task_id = p_task_id AND t.outcome IS NULL;
        RETURN QUERY SELECT 'rejected'::text, v_new, NULL::bigint, NULL::integer,
                            'waiting room of ' || p_key || ' is full';
        RETURN;
    END IF;
    -- The parked row (waiting.WAITING_INSERT): latest start = the earlier of expires and arrival + max_wait.
    INSERT INTO keyed_waiting (task_id, attempt, key, group_key, group_seq, priority, arrival, arrived_at, not_before,
                               deadline, supersede_key, shadow, group_blocked, queue, message, keys, cost,
                               reserved_keys, reserved_shards, reserved_at, fair_key)
    VALUES (p_task_id, p_attempt, p_key, NULL, NULL, p_priority, nextval('keyed_arrival_seq'), v_now, NULL,
            LEAST(p_deadline, v_now + (SELECT make_interval(secs => c.max_wait) FROM keyed_names c WHERE c.name = v_name)),
            NULL, false, false, p_queue, p_message, NULL, 1, NULL, NULL, NULL, p_fair_key);
    RETURN QUERY SELECT 'parked'::text, v_new, NULL::bigint, NULL::integer, ''::text;
END
$$;

-- keyed_admit_plain: keyed_admit_or_park_plain deciding (admit or park), for the admission of an arrival whose
-- pool process is ready (D3).
CREATE FUNCTION keyed_admit_plain(
    p_task_id text, p_attempt integer, p_task_name text, p_key text, p_priority integer, p_deadline timestamptz,
    p_queue text, p_message jsonb, p_fair_key text, p_holder text, p_lease double precision, p_now timestamptz)
RETURNS TABLE (verdict text, new boolean, fence bigint, shard integer, detail text)
LANGUAGE sql AS $$
    SELECT * FROM keyed_admit_or_park_plain(p_task_id, p_attempt, p_task_name, p_key, p_priority, p_deadline,
                                            p_queue, p_message, p_fair_key, p_holder, p_lease, p_now, false)
$$;

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

-- Sent: one row per task accepted at send (keyed_admit_at_send) until reconcile drops it (its task has a final
-- outcome, or it never arrived before expires_at). key: the task's first concurrency key, whose waiting
-- room the send was counted in; dedupe_key: at most one live task per dedupe key (live = no final outcome in the
-- books, and arrived or sent within the arrival timeout). Both rules are decided by keyed_admit_at_send under
-- locks (an advisory lock per dedupe key, then the key's keyed_keys row), never by reading in Python.
CREATE TABLE keyed_sent (
    task_id text PRIMARY KEY,
    key text NOT NULL,
    dedupe_key text,
    sent_at timestamptz NOT NULL,
    -- until when a send that has not arrived holds its place (sent_at + the producer's keyed_send_arrival_timeout)
    expires_at timestamptz NOT NULL
);
CREATE INDEX keyed_sent_key_idx ON keyed_sent (key);
CREATE INDEX keyed_sent_dedupe_idx ON keyed_sent (dedupe_key) WHERE dedupe_key IS NOT NULL;

-- Send refusals: how many sends of a name keyed_admit_at_send refused, by reason (room_full, duplicate). A refused
-- send publishes nothing and books nothing in keyed_tasks (the task id never arrived); this is its only record.
CREATE TABLE keyed_send_refusals (
    name text NOT NULL,
    reason text NOT NULL,
    refused bigint NOT NULL DEFAULT 0,
    last_at timestamptz NOT NULL,
    PRIMARY KEY (name, reason),
    CONSTRAINT keyed_send_refusals_reason_known CHECK (reason IN ('room_full', 'duplicate'))
);

-- keyed_admit_at_send: the producer's one round trip before publishing a keyed task with keyed_admit_at_send.
-- verdict: 'accepted' (a keyed_sent row now holds the task's place; detail 'known' when the task id already had one,
-- or is an open task in the books: a retry or a re-send), 'duplicate' (holder_task_id: the live task with the same
-- dedupe key), 'room_full' (waiting + accepted-not-yet-parked >= max_waiting of the name, overflow 'reject').
-- The room of a key at send = keyed_keys.waiting (parked attempts) + its reservations whose task is neither parked,
-- running nor finished (sent and not arrived before its expires_at, or between attempts); p_arrival_timeout sets the new
-- row's expires_at. Park and claim
-- move a task out of "pending" in the same transaction that puts it in waiting or in a claim, so nothing is
-- counted twice or missed by a snapshot.
-- Locks: an advisory transaction lock per dedupe key (only senders take it), then the key's keyed_keys row (lock
-- order 3; a sender takes no task row and no slot row). Each check is a later statement than the lock it needs
-- (READ COMMITTED: a new snapshot that sees every sender that held the lock before). A refusal counts itself in
-- keyed_send_refusals and leaves no keyed_sent row.
CREATE FUNCTION keyed_admit_at_send(
    p_task_id text, p_key text, p_name text, p_dedupe_key text, p_arrival_timeout double precision,
    p_now timestamptz)
RETURNS TABLE (verdict text, detail text, holder_task_id text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := COALESCE(p_now, now());
    v_other text;
    v_room integer;
    v_overflow text;
    v_waiting integer;
    v_pending integer;
BEGIN
    -- The task's own place: a retry or a re-send of the same task id is accepted again, reserving nothing more.
    IF EXISTS (SELECT 1 FROM keyed_sent s WHERE s.task_id = p_task_id)
       OR EXISTS (SELECT 1 FROM keyed_tasks t WHERE t.task_id = p_task_id AND t.outcome IS NULL) THEN
        RETURN QUERY SELECT 'accepted'::text, 'known'::text, NULL::text;
        RETURN;
    END IF;
    -- Dedupe (one live task per dedupe key): senders of one dedupe key decide one after the other.
    IF p_dedupe_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('keyed_sent:' || p_dedupe_key, 0));
        SELECT s.task_id INTO v_other FROM keyed_sent s LEFT JOIN keyed_tasks t ON t.task_id = s.task_id
         WHERE s.dedupe_key = p_dedupe_key AND t.outcome IS NULL AND (t.task_id IS NOT NULL OR s.expires_at > v_now)
         ORDER BY s.sent_at LIMIT 1;
        IF v_other IS NOT NULL THEN
            INSERT INTO keyed_send_refusals AS r (name, reason, refused, last_at) VALUES (p_name, 'duplicate', 1, v_now)
            ON CONFLICT (name, reason) DO UPDATE SET refused = r.refused + 1, last_at = excluded.last_at;
            RETURN QUERY SELECT 'duplicate'::text, ('dedupe key ' || p_dedupe_key || ' is live in task ' || v_other),
                                v_other;
            RETURN;
        END IF;
    END IF;
    -- The waiting room (max_waiting under overflow 'reject'; an unbounded room or 'supersede' never refuses here).
    SELECT c.max_waiting, c.overflow INTO v_room, v_overflow FROM keyed_names c WHERE c.name = p_name;
    IF v_room IS NOT NULL AND v_overflow = 'reject' THEN
        -- The key's head row, created if missing, locked: parks and promotions of the key change waiting under it.
        INSERT INTO keyed_keys (key, name, waiting, active_at) VALUES (p_key, p_name, 0, v_now)
        ON CONFLICT (key) DO UPDATE SET active_at = excluded.active_at;
        SELECT k.waiting INTO v_waiting FROM keyed_keys k WHERE k.key = p_key;
        SELECT count(*) INTO v_pending FROM keyed_sent s LEFT JOIN keyed_tasks t ON t.task_id = s.task_id
         WHERE s.key = p_key AND t.outcome IS NULL AND (t.task_id IS NOT NULL OR s.expires_at > v_now)
           AND NOT EXISTS (SELECT 1 FROM keyed_waiting w WHERE w.task_id = s.task_id)
           AND NOT EXISTS (SELECT 1 FROM keyed_claims c WHERE c.task_id = s.task_id);
        IF v_waiting + v_pending >= v_room THEN
            INSERT INTO keyed_send_refusals AS r (name, reason, refused, last_at) VALUES (p_name, 'room_full', 1, v_now)
            ON CONFLICT (name, reason) DO UPDATE SET refused = r.refused + 1, last_at = excluded.last_at;
            RETURN QUERY SELECT 'room_full'::text,
                                ('waiting room of ' || p_key || ' is full (' || v_waiting || ' waiting, ' || v_pending
                                 || ' sent, max_waiting ' || v_room || ')'),
                                NULL::text;
            RETURN;
        END IF;
    END IF;
    INSERT INTO keyed_sent (task_id, key, dedupe_key, sent_at, expires_at)
    VALUES (p_task_id, p_key, p_dedupe_key, v_now, v_now + make_interval(secs => p_arrival_timeout));
    RETURN QUERY SELECT 'accepted'::text, ''::text, NULL::text;
END
$$;

-- Outbox (migration 0008, issue 14 item 8): keyed messages registered at publish and not received yet.
-- Outbox: one row per task registered at publish and not received by a worker yet. message: the broker message
-- as the ledger stores a parked one (messages.record_published: body base64, content type and encoding, headers,
-- properties, exchange, routing key). due_at: when the relay publishes it (again): the registration time for a
-- registration made in the caller's transaction (pending: not published yet, the relay's first publish is not a
-- republish), else the expected arrival (the later of now and its ETA) + the arrival timeout. republished: how
-- many times the relay published it again from this copy (a duplicate of a received copy is dropped by D8).
CREATE TABLE keyed_outbox (
    task_id text PRIMARY KEY,
    task_name text NOT NULL DEFAULT '',
    key text,
    group_key text,
    message jsonb NOT NULL,
    registered_at timestamptz NOT NULL,
    due_at timestamptz NOT NULL,
    pending boolean NOT NULL DEFAULT false,
    republished integer NOT NULL DEFAULT 0,
    republished_at timestamptz,
    -- the relay's count only grows from zero (a negative count is a bug, not a state)
    CONSTRAINT keyed_outbox_republished_nonnegative CHECK (republished >= 0)
);
-- The relay takes the rows that are due, oldest first, without reading the rest.
CREATE INDEX keyed_outbox_due_idx ON keyed_outbox (due_at);

-- keyed_outbox_received: a task registered at publish is never republished after its arrival is recorded. Every
-- arrival (the fast claims, keyed_claim_many, keyed_admit_plain, the general admission, a rejection of unreadable
-- keys, a revoke before arrival, a group number recorded lost) inserts the task's keyed_tasks row; this trigger
-- deletes its outbox row in that same statement, so "received" and "still to deliver" never coexist. A task id that
-- arrived earlier is never registered (outbox.OUTBOX_REGISTER), and the relay drops a row whose task it finds in
-- the books (a registration that raced a revoke).
CREATE FUNCTION keyed_outbox_received() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM keyed_outbox o WHERE o.task_id = NEW.task_id;
    RETURN NULL;
END
$$;
CREATE TRIGGER keyed_tasks_outbox_received AFTER INSERT ON keyed_tasks
    FOR EACH ROW EXECUTE FUNCTION keyed_outbox_received();

-- 0023: a retry is a publish like any other. A retry's message can be lost between the worker that published it and
-- the next one (a worker killed after taking it off the broker's list, before the broker counted it as unacked):
-- the task would stay between attempts for ever. A keyed retry is registered in keyed_outbox when it is published,
-- keyed by the attempt it starts: attempt = n for retry number n (0, the default, for a task's first publish). With
-- the outbox on for the task, the row keeps a copy of the message and the relay publishes it again when attempt n
-- has not arrived by its due time; without it the row keeps no copy (message NULL): the relay skips it, and
-- reconcile reports it once it is overdue (reported: it was; kind 'retry_missing' in keyed_events).
ALTER TABLE keyed_outbox ADD COLUMN attempt integer NOT NULL DEFAULT 0;
ALTER TABLE keyed_outbox ADD COLUMN reported boolean NOT NULL DEFAULT false;
ALTER TABLE keyed_outbox ALTER COLUMN message DROP NOT NULL;
ALTER TABLE keyed_outbox ADD CONSTRAINT keyed_outbox_attempt_nonnegative CHECK (attempt >= 0);
-- only a retry's row may go without a copy (a first publish is registered only to be delivered)
ALTER TABLE keyed_outbox ADD CONSTRAINT keyed_outbox_copy_unless_retry CHECK (message IS NOT NULL OR attempt > 0);

ALTER TABLE keyed_events DROP CONSTRAINT keyed_events_kind_known;
ALTER TABLE keyed_events ADD CONSTRAINT keyed_events_kind_known
    CHECK (kind IN ('drift', 'forced_release', 'reclaimed', 'duplicate', 'retry_missing'));

-- keyed_outbox_attempt_arrived: a retry's row goes in the statement that records the arrival of its attempt (or of
-- a later one): every admitted attempt inserts a claim or a waiting row. Only for attempts after the first (the
-- WHEN clauses: a first arrival is keyed_tasks_outbox_received's, and costs nothing more here). An arrival that
-- ends the task without a claim or a waiting row (expired, revoked) leaves the row to the relay and reconcile,
-- which drop it (outbox.OUTBOX_RETRY_OVER).
CREATE FUNCTION keyed_outbox_attempt_arrived() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM keyed_outbox o WHERE o.task_id = NEW.task_id AND o.attempt > 0 AND o.attempt <= NEW.attempt;
    RETURN NULL;
END
$$;
CREATE TRIGGER keyed_claims_outbox_arrived AFTER INSERT ON keyed_claims
    FOR EACH ROW WHEN (NEW.attempt > 0) EXECUTE FUNCTION keyed_outbox_attempt_arrived();
CREATE TRIGGER keyed_waiting_outbox_arrived AFTER INSERT ON keyed_waiting
    FOR EACH ROW WHEN (NEW.attempt > 0) EXECUTE FUNCTION keyed_outbox_attempt_arrived();

-- 0025: a failover is an outage, named. The ledger remembers the identity of the server that last wrote it (system
-- identifier, timeline, postmaster start). A server whose identity differs (a standby promoted: a new timeline; a
-- restart: a new postmaster start) may have lost the previous server's last commits, among them claims of bodies
-- that still run: until every claim the previous server may have granted has lapsed (one lease from the change's
-- detection, hold_until) no claim is inserted except the re-assertion of a running attempt's own claim.
-- one_row: the ledger has one identity (the row is written by keyed_ledger_identity_check, never by hand)
CREATE TABLE keyed_ledger_identity (
    one_row boolean PRIMARY KEY DEFAULT true,
    system_identifier bigint NOT NULL,
    timeline integer NOT NULL,
    postmaster_start timestamptz NOT NULL,
    seen_at timestamptz NOT NULL,
    hold_until timestamptz,
    CONSTRAINT keyed_ledger_identity_one_row CHECK (one_row)
);

ALTER TABLE keyed_events DROP CONSTRAINT keyed_events_kind_known;
ALTER TABLE keyed_events ADD CONSTRAINT keyed_events_kind_known
    CHECK (kind IN ('drift', 'forced_release', 'reclaimed', 'duplicate', 'retry_missing', 'failover', 'reasserted',
                    'group_held', 'group_resumed', 'group_head_skipped'));

-- keyed_ledger_timeline: the timeline this server writes on (a primary's WAL insert timeline; a standby's last
-- checkpoint's). Read from memory, no file: cheap enough for every claim insert.
CREATE FUNCTION keyed_ledger_timeline() RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF pg_is_in_recovery() THEN
        RETURN (SELECT timeline_id FROM pg_control_checkpoint());
    END IF;
    RETURN ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::integer;
END
$$;

-- keyed_ledger_identity_check: a client's first contact with a server (each new connection, each heartbeat, each
-- reconcile). Compares the server's identity with the one remembered; a change is recorded (the new identity, a
-- 'failover' event) and holds new starts until now + p_lease (the longest lease asked for wins). kind: NULL (same
-- server, or the first contact ever), 'promoted' (new timeline), 'replaced' (another system identifier) or
-- 'restarted' (new postmaster start only). A standby answers and writes nothing. Concurrent first contacts: the
-- UPDATE's guard makes exactly one of them the detector; the others read the recorded hold.
CREATE FUNCTION keyed_ledger_identity_check(p_lease double precision, OUT kind text, OUT previous text,
                                            OUT current_identity text, OUT hold_until timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
    v_sys bigint := (SELECT c.system_identifier FROM pg_control_system() c);
    v_tli integer := keyed_ledger_timeline();
    v_start timestamptz := pg_postmaster_start_time();
    r keyed_ledger_identity;
BEGIN
    current_identity := format('system %s, timeline %s, started %s', v_sys, v_tli, v_start);
    IF pg_is_in_recovery() THEN
        RETURN;
    END IF;
    SELECT * INTO r FROM keyed_ledger_identity;
    IF NOT FOUND THEN
        INSERT INTO keyed_ledger_identity (system_identifier, timeline, postmaster_start, seen_at)
        VALUES (v_sys, v_tli, v_start, now()) ON CONFLICT DO NOTHING;
        RETURN;
    END IF;
    IF (r.system_identifier, r.timeline, r.postmaster_start) = (v_sys, v_tli, v_start) THEN
        hold_until := r.hold_until;
        RETURN;
    END IF;
    -- A restart of the same server (same system, same timeline) lost nothing: every ledger transaction whose
    -- outcome matters commits with synchronous_commit on (durable before it returns), so no claim it granted is
    -- gone and nothing is held; only a new timeline or another system may have lost the last commits.
    UPDATE keyed_ledger_identity i
       SET system_identifier = v_sys, timeline = v_tli, postmaster_start = v_start, seen_at = now(),
           hold_until = CASE WHEN (i.system_identifier, i.timeline) = (v_sys, v_tli) THEN i.hold_until
                             ELSE GREATEST(i.hold_until, now() + make_interval(secs => p_lease)) END
     WHERE (i.system_identifier, i.timeline, i.postmaster_start) IS DISTINCT FROM (v_sys, v_tli, v_start)
    RETURNING i.hold_until INTO hold_until;
    IF NOT FOUND THEN  -- another first contact recorded it meanwhile
        SELECT i.hold_until INTO hold_until FROM keyed_ledger_identity i;
        RETURN;
    END IF;
    kind := CASE WHEN r.system_identifier <> v_sys THEN 'replaced'
                 WHEN r.timeline <> v_tli THEN 'promoted'
                 ELSE 'restarted' END;
    IF kind = 'restarted' THEN
        RETURN;
    END IF;
    previous := format('system %s, timeline %s, started %s', r.system_identifier, r.timeline, r.postmaster_start);
    INSERT INTO keyed_events (kind, detail, at)
    VALUES ('failover', format('%s: %s -> %s; no new start until %s', kind, previous, current_identity, hold_until),
            now());
END
$$;

-- keyed_failover_holding: whether new starts wait (a recorded hold not over, or a server whose identity nobody has
-- checked yet). The reaper waits too: a running attempt re-asserts or renews its claim on the new server first.
-- (PL/pgSQL: its statement's plan is kept for the session; as a SQL function it was planned at every claim.)
-- The server's own identity (system identifier and timeline) is read once per session and kept in the session
-- setting keyed.server (0030): it cannot change under a session that has seen the server as a primary (a timeline
-- changes only when a standby is promoted; a session on a standby inserts nothing and caches nothing), and reading
-- it was most of the cost of every claim's guard (pg_control_system reads the control file). Only the recorded
-- hold is read each time (another session may record it).
CREATE FUNCTION keyed_failover_holding() RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_server text := current_setting('keyed.server', true);
BEGIN
    IF v_server IS NULL OR v_server = '' THEN
        IF pg_is_in_recovery() THEN
            RETURN true;
        END IF;
        v_server := (SELECT c.system_identifier FROM pg_control_system() c) || '/' || keyed_ledger_timeline();
        PERFORM set_config('keyed.server', v_server, false);
    END IF;
    RETURN EXISTS (SELECT 1 FROM keyed_ledger_identity i
                    WHERE i.hold_until > now() OR i.system_identifier || '/' || i.timeline <> v_server);
END
$$;

-- keyed_claims_failover_guard: no claim is inserted while keyed_failover_holding(), except by
-- keyed_claims_reassert (a body that runs takes its own claim back). The error is the server's "cannot connect now"
-- (57P03): to a worker the ledger is unavailable for a moment; it holds the task and tries again.
CREATE FUNCTION keyed_claims_failover_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- Asked once per transaction (keyed.guard_passed is local to it): its later claims commit with its first, as
    -- one claim would.
    IF current_setting('keyed.guard_passed', true) = 'on' OR current_setting('keyed.reassert', true) = 'on' THEN
        RETURN NEW;
    END IF;
    IF NOT keyed_failover_holding() THEN
        PERFORM set_config('keyed.guard_passed', 'on', true);
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'celery-keyed: after a failover of the ledger no new start until the previous server''s claims have lapsed'
        USING ERRCODE = '57P03';
END
$$;
CREATE TRIGGER keyed_claims_failover_guard BEFORE INSERT ON keyed_claims
    FOR EACH ROW EXECUTE FUNCTION keyed_claims_failover_guard();

-- keyed_claims_reassert: a worker whose running attempt's claim is missing (lost with the previous server's last
-- commits) takes it back, with the same fence, under the slot guard (used + cost <= share, as any claim): 'kept'
-- (the claim is there with this fence: renewed), 'reasserted', or 'refused' (the slot was taken meanwhile, another
-- claim of the attempt exists, the task has an outcome, or the claim held more than one key's slots: the worker
-- stops the body, which runs again). The task's row is recorded if it was lost too, so its outcome has books.
CREATE FUNCTION keyed_claims_reassert(p_task_id text, p_attempt integer, p_fence bigint, p_holder text, p_key text,
                                      p_shard integer, p_name text, p_cost integer, p_task_name text,
                                      p_lease double precision) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_fence bigint;
    v_shard integer;
    v_try integer;
BEGIN
    PERFORM 1 FROM keyed_tasks WHERE task_id = p_task_id FOR UPDATE;
    SELECT c.fence INTO v_fence FROM keyed_claims c WHERE c.task_id = p_task_id AND c.attempt = p_attempt FOR UPDATE;
    IF FOUND THEN
        IF v_fence <> p_fence THEN
            RETURN 'refused';
        END IF;
        UPDATE keyed_claims SET state = 'running', holder = p_holder, nonce = NULL, dispatch_deadline = NULL,
               lease_expires_at = now() + make_interval(secs => p_lease)
         WHERE task_id = p_task_id AND attempt = p_attempt AND state IN ('running', 'promoted');
        RETURN CASE WHEN FOUND THEN 'kept' ELSE 'refused' END;
    END IF;
    IF p_key IS NULL OR EXISTS (SELECT 1 FROM keyed_tasks WHERE task_id = p_task_id AND outcome IS NOT NULL) THEN
        RETURN 'refused';
    END IF;
    INSERT INTO keyed_slots (key, shard, name, used)
    SELECT p_key, g, p_name, 0 FROM generate_series(0, keyed_name_shards(p_name) - 1) AS g
    ON CONFLICT (key, shard) DO NOTHING;
    -- the claim's own shard, or (p_shard NULL: not known) the first shard where it fits; each take is guarded
    v_shard := NULL;
    FOR v_try IN SELECT g FROM generate_series(0, keyed_name_shards(p_name) - 1) AS g
                  WHERE p_shard IS NULL OR g = p_shard LOOP
        UPDATE keyed_slots s SET used = s.used + p_cost
         WHERE s.key = p_key AND s.shard = v_try
           AND s.used + p_cost <= keyed_row_share(p_key, now(), s.shards, keyed_name_shards(s.name), s.shard)
        RETURNING s.shard INTO v_shard;
        EXIT WHEN v_shard IS NOT NULL;
    END LOOP;
    IF v_shard IS NULL THEN
        RETURN 'refused';
    END IF;
    INSERT INTO keyed_tasks (task_id, task_name, key, arrived_at) VALUES (p_task_id, p_task_name, p_key, now())
    ON CONFLICT (task_id) DO NOTHING;
    PERFORM set_config('keyed.reassert', 'on', true);
    INSERT INTO keyed_claims (task_id, attempt, key, shard, state, fence, holder, lease_expires_at, claimed_at, cost)
    VALUES (p_task_id, p_attempt, p_key, v_shard, 'running', p_fence, p_holder,
            now() + make_interval(secs => p_lease), now(), p_cost);
    PERFORM set_config('keyed.reassert', 'off', true);
    PERFORM setval('keyed_fence_seq', GREATEST(p_fence, (SELECT last_value FROM keyed_fence_seq)));
    INSERT INTO keyed_events (kind, key, task_id, detail, at)
    VALUES ('reasserted', p_key, p_task_id, format('attempt %s, fence %s, holder %s', p_attempt, p_fence, p_holder),
            now());
    RETURN 'reasserted';
END
$$;

-- keyed_books_settle: the books of an attempt that ended with a final outcome on the previous server, of which this
-- one has neither the outcome nor a claim (the arrival and the release were both lost): its outcome is recorded from
-- what the worker that ran it remembers (its result is stored in the result backend already: notified). Nothing is
-- written when the task has an outcome, or a claim or waiting row of this attempt or a later one. True: recorded.
CREATE FUNCTION keyed_books_settle(p_task_id text, p_attempt integer, p_task_name text, p_key text, p_outcome text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF p_outcome NOT IN ('completed', 'failed') THEN
        RETURN false;
    END IF;
    PERFORM 1 FROM keyed_tasks WHERE task_id = p_task_id FOR UPDATE;
    IF EXISTS (SELECT 1 FROM keyed_claims WHERE task_id = p_task_id AND attempt >= p_attempt)
       OR EXISTS (SELECT 1 FROM keyed_waiting WHERE task_id = p_task_id AND attempt >= p_attempt) THEN
        RETURN false;
    END IF;
    INSERT INTO keyed_tasks AS t (task_id, task_name, key, arrived_at, outcome, finished_attempt, finished_at,
                                  detail, notified)
    VALUES (p_task_id, p_task_name, p_key, now(), p_outcome, p_attempt, now(),
            'settled after a failover of the ledger', true)
    ON CONFLICT (task_id) DO UPDATE
       SET outcome = EXCLUDED.outcome, finished_attempt = EXCLUDED.finished_attempt,
           finished_at = EXCLUDED.finished_at, detail = EXCLUDED.detail, notified = true
     WHERE t.outcome IS NULL;
    RETURN FOUND;
END
$$;

-- keyed_failover_reaper_waits: the reaper waits one more lease after a hold (two from the failover's detection): the
-- claims the previous server had, whose releases were lost with it, are released again by their workers meanwhile
-- (the promotions those releases make wait for the hold's end) instead of being reclaimed as expired.
CREATE FUNCTION keyed_failover_reaper_waits() RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN keyed_failover_holding()
        OR EXISTS (SELECT 1 FROM keyed_ledger_identity i WHERE i.hold_until + (i.hold_until - i.seen_at) > now());
END
$$;

-- keyed_books_settle_from_result: the books of a task lost with a failover whose worker died too, settled by the
-- reconciler from the task's result in the result backend (its only trace): SUCCESS completed, FAILURE failed, or the
-- never-ran outcome whose Keyed… failure the ledger had stored (rejected, expired, …). Guarded as keyed_books_settle:
-- the task's row locked, nothing written while an attempt of it (this one or a later) is claimed or waiting, and the
-- outcome inserted only where the task has none. True: recorded by this call.
CREATE FUNCTION keyed_books_settle_from_result(p_task_id text, p_attempt integer, p_task_name text, p_key text,
                                               p_outcome text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF p_outcome NOT IN ('completed', 'failed', 'dead_lettered', 'expired', 'rejected', 'superseded', 'revoked',
                         'lost') THEN
        RETURN false;
    END IF;
    PERFORM 1 FROM keyed_tasks WHERE task_id = p_task_id FOR UPDATE;
    IF EXISTS (SELECT 1 FROM keyed_claims WHERE task_id = p_task_id AND attempt >= p_attempt)
       OR EXISTS (SELECT 1 FROM keyed_waiting WHERE task_id = p_task_id AND attempt >= p_attempt) THEN
        RETURN false;
    END IF;
    INSERT INTO keyed_tasks AS t (task_id, task_name, key, arrived_at, outcome, finished_attempt, finished_at,
                                  detail, notified)
    VALUES (p_task_id, p_task_name, p_key, now(), p_outcome, p_attempt, now(),
            'settled from its result after a failover of the ledger', true)
    ON CONFLICT (task_id) DO UPDATE
       SET outcome = EXCLUDED.outcome, finished_attempt = EXCLUDED.finished_attempt,
           finished_at = EXCLUDED.finished_at, detail = EXCLUDED.detail, notified = true, message = NULL
     WHERE t.outcome IS NULL;
    RETURN FOUND;
END
$$;

-- keyed_take_rate: take what a start of cost p_cost needs from a rate-limited key (the caller holds its keyed_keys
-- row locked): tokens of its name's bucket and one position per cost in each of its windows, all or none. unrated:
-- the name has neither; took: taken; else next_at: when every one of them would let it (its bucket's tokens exist,
-- each window's oldest start in the way is a window old), for the attempt's not-before time (D2: no polling).
-- A cost above a window's N never fits (admission rejects it first: names.NAMES_LARGEST_SHARE).
CREATE FUNCTION keyed_take_rate(p_key text, p_name text, p_cost integer, p_now timestamptz,
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
