-- 0031: the books keep every key of a task of several keys (the admin's task outcomes and explain show them all),
-- written with the task's arrival; NULL for a task of one key (nothing more on the hot path).

ALTER TABLE keyed_tasks ADD COLUMN extra_keys text[];
