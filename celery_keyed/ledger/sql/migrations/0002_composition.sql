-- 0002: composition (issue 4): several concurrency keys per attempt, weighted slots, uncertain holds.

-- Claims hold their first key in (key, shard) and any further keys in extra_keys/extra_shards (same order);
-- cost slots of each. state 'uncertain': the attempt is over but its slots stay held until lease_expires_at,
-- because the remote call it made may still be running (uncertain_hold); held_outcome is how it ended.
ALTER TABLE keyed_claims
    ADD COLUMN cost integer NOT NULL DEFAULT 1,
    ADD COLUMN extra_keys text[],
    ADD COLUMN extra_shards integer[],
    ADD COLUMN held_outcome text,
    ADD CONSTRAINT keyed_claims_cost_positive CHECK (cost >= 1),
    ADD CONSTRAINT keyed_claims_extra_with_key CHECK (extra_keys IS NULL OR key IS NOT NULL),
    ADD CONSTRAINT keyed_claims_extra_shards_match CHECK (
        cardinality(extra_keys) IS NOT DISTINCT FROM cardinality(extra_shards)),
    DROP CONSTRAINT keyed_claims_state_known,
    ADD CONSTRAINT keyed_claims_state_known CHECK (state IN ('running', 'promoted', 'uncertain')),
    ADD CONSTRAINT keyed_claims_uncertain_has_outcome CHECK ((state = 'uncertain') = (held_outcome IS NOT NULL)),
    -- a running attempt that gave its slots back early (release_concurrency) keeps its row as the record of
    -- the attempt (books, fence) until its outcome
    DROP CONSTRAINT keyed_claims_holds_something,
    ADD CONSTRAINT keyed_claims_holds_something CHECK (key IS NOT NULL OR group_key IS NOT NULL OR state = 'running');
CREATE INDEX keyed_claims_extra_idx ON keyed_claims USING gin (extra_keys) WHERE extra_keys IS NOT NULL;
CREATE INDEX keyed_claims_uncertain_idx ON keyed_claims (lease_expires_at) WHERE state = 'uncertain';

-- A parked attempt with several keys (keys, in the task's order) stands in the line of one key it lacks (key).
-- reserved_keys/reserved_shards: slots of keys listed before that one which it holds while it waits (counted
-- in keyed_slots.used; given back when it starts, leaves, or the reservation lapses at reserved_at + timeout).
-- cost slots of each key.
ALTER TABLE keyed_waiting
    ADD COLUMN keys text[],
    ADD COLUMN cost integer NOT NULL DEFAULT 1,
    ADD COLUMN reserved_keys text[],
    ADD COLUMN reserved_shards integer[],
    ADD COLUMN reserved_at timestamptz,
    ADD CONSTRAINT keyed_waiting_cost_positive CHECK (cost >= 1),
    ADD CONSTRAINT keyed_waiting_keys_with_key CHECK (keys IS NULL OR key IS NOT NULL),
    ADD CONSTRAINT keyed_waiting_reserved_shards_match CHECK (
        cardinality(reserved_keys) IS NOT DISTINCT FROM cardinality(reserved_shards)),
    ADD CONSTRAINT keyed_waiting_reserved_when CHECK ((reserved_keys IS NULL) = (reserved_at IS NULL));
CREATE INDEX keyed_waiting_reserved_idx ON keyed_waiting (reserved_at) WHERE reserved_at IS NOT NULL;

-- Names: seconds a slot stays held after a hard time limit or a lost worker (the remote call may still run);
-- a token bucket per key (rate tokens per second, up to burst); fair: waiters share the key's slots round-robin
-- by their fair key (e.g. the tenant) instead of one FIFO line.
ALTER TABLE keyed_names
    ADD COLUMN uncertain_hold double precision,
    ADD COLUMN rate double precision,
    ADD COLUMN burst double precision,
    ADD COLUMN fair boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT keyed_names_uncertain_hold_positive CHECK (uncertain_hold > 0),
    ADD CONSTRAINT keyed_names_rate_positive CHECK (rate > 0),
    ADD CONSTRAINT keyed_names_burst_with_rate CHECK (burst IS NULL OR (rate IS NOT NULL AND burst >= 1));

-- Keys: the token bucket of a rate-limited key: tokens left at tokens_at (refilled lazily, under the row lock).
ALTER TABLE keyed_keys
    ADD COLUMN tokens double precision,
    ADD COLUMN tokens_at timestamptz;

-- Fair sharing: the fair key of a parked attempt and of a claim (who holds how many slots of a fair key).
ALTER TABLE keyed_waiting ADD COLUMN fair_key text;
ALTER TABLE keyed_claims ADD COLUMN fair_key text;
CREATE INDEX keyed_waiting_fair_idx ON keyed_waiting (key, fair_key, priority DESC, arrival)
    WHERE NOT shadow AND not_before IS NULL AND NOT group_blocked;
CREATE INDEX keyed_claims_fair_idx ON keyed_claims (key, fair_key) WHERE fair_key IS NOT NULL;
