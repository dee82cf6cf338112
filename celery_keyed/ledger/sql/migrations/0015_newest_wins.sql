-- 0015: newest wins (issue 14 item 1). A task with on_newer='cancel_running' that arrives while an older attempt of
-- its first key and supersede key (else task name) holds a slot asks for that attempt's cancellation, in the
-- arrival's own transaction (ledger/admit.py): the claim row is marked, the worker holding it learns it at its next
-- heartbeat renewal (or at once from the cancel broadcast), ends the attempt (prefork: terminates its pool process;
-- other pools: self.keyed_cancelled() turns true) and releases it with outcome 'superseded', which frees the slot
-- for the newest through the ordinary release-and-promote path: the bound is never bypassed.
-- supersede_key: the supersede key of a claim taken by the general admission path (a promoted claim keeps it in
-- parked); cancel_requested_at / cancel_detail: when and by whom its cancellation was asked (set once).
ALTER TABLE keyed_claims ADD COLUMN supersede_key text;
ALTER TABLE keyed_claims ADD COLUMN cancel_requested_at timestamptz;
ALTER TABLE keyed_claims ADD COLUMN cancel_detail text;
ALTER TABLE keyed_claims ADD CONSTRAINT keyed_claims_cancel_detail_when
    CHECK ((cancel_requested_at IS NULL) = (cancel_detail IS NULL));
-- The heartbeat asks which of its claims have a cancellation pending (few rows: a partial index).
CREATE INDEX keyed_claims_cancel_idx ON keyed_claims (holder) WHERE cancel_requested_at IS NOT NULL;
