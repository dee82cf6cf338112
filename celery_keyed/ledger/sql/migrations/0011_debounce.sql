-- 0011: debounce per key (issue 14 item 2). A debounced arrival parks until its key has been quiet for the
-- task's debounce period, at most debounce_max after the first arrival of the burst; arrivals of the same burst
-- replace each other (keep last) or are dropped (keep first), each recorded 'superseded' (ledger/admit.py).
-- debounce_key: what identifies the burst within its line (the task's supersede key, else its task name);
-- debounce_cap: the latest due time of the burst (its first arrival + debounce_max). A row is debounced iff both
-- are set; its burst is open (it absorbs arrivals) while its not_before is in the future.
ALTER TABLE keyed_waiting ADD COLUMN debounce_key text;
ALTER TABLE keyed_waiting ADD COLUMN debounce_cap timestamptz;
ALTER TABLE keyed_waiting ADD CONSTRAINT keyed_waiting_debounce_pair
    CHECK ((debounce_key IS NULL) = (debounce_cap IS NULL));
-- The open burst of a (key, debounce key) is found by this index (an arrival looks for it under the key's head row lock).
CREATE INDEX keyed_waiting_debounce_idx ON keyed_waiting (key, debounce_key) WHERE debounce_key IS NOT NULL;
