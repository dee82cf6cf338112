-- 0003: books retention (issue 9 item 12): reconcile forgets finished task ids older than keyed_books_retention.

-- Books pruned: how many task ids of each final outcome were pruned from keyed_tasks, so that the books still
-- balance over every task id that ever arrived (a pruned row is counted here in the same statement that deletes it).
CREATE TABLE keyed_books_pruned (
    outcome text PRIMARY KEY,
    tasks bigint NOT NULL DEFAULT 0,
    CONSTRAINT keyed_books_pruned_outcome_known CHECK (outcome IN (
        'completed', 'failed', 'dead_lettered', 'expired', 'rejected', 'superseded', 'revoked', 'lost')),
    CONSTRAINT keyed_books_pruned_tasks_nonnegative CHECK (tasks >= 0)
);

-- Finished task ids by finish time: the retention prune takes the oldest first, a batch at a time.
CREATE INDEX keyed_tasks_finished_idx ON keyed_tasks (finished_at) WHERE outcome IS NOT NULL;
