-- 0013: generic plans for keyed_release_many (issue 12 item 4: CPU per cycle).
-- keyed_release_many runs with generic plans : every statement in it reaches rows by primary key or by the
-- (key, shard) pairs it was given, where a custom plan is never better, and planning each of them again at every
-- call (the default for parameterised statements whose generic plan is not cheaper by estimate) was most of its
-- server time: 1.4-1.7 ms of self time per call against 0.5-0.7 ms (one client, durable PostgreSQL).
ALTER FUNCTION keyed_release_many(text[], integer[], bigint[], text[], text[], timestamptz)
    SET plan_cache_mode = force_generic_plan;
