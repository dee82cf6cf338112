-- 0017: the sweep without scans of the whole waiting room (docs/benchmarks.md, "What the 1,000,000-row run found").
-- Every worker sweeps every keyed_sweep_interval. Two of its reads went through every parked row on every sweep:
-- the orphan shadows (waiting.WAITING_ORPHAN_SHADOWS, WHERE shadow) and the attempts with several keys
-- (waiting.WAITING_MULTI_PROMOTABLE, WHERE keys IS NOT NULL): 90 and 96 ms each with 1,000,000 parked rows.
-- Both kinds of rows are rare; a partial index holds only them, so each read is an index scan of the few.
CREATE INDEX IF NOT EXISTS keyed_waiting_shadow_idx ON keyed_waiting (task_id, attempt) WHERE shadow;
CREATE INDEX IF NOT EXISTS keyed_waiting_multi_idx ON keyed_waiting (priority DESC, arrival)
    WHERE keys IS NOT NULL AND NOT shadow AND not_before IS NULL AND NOT group_blocked;
