"""The books: one row per task id that arrived (table ``keyed_tasks``), and its one final outcome (D11).

Invariant: a task's outcome is recorded exactly once — ``books_finish`` is guarded by ``outcome IS NULL`` and
its row count is the answer. completed + failed + dead_lettered + expired + rejected + superseded + revoked +
still open (outcome NULL) = arrivals; ``lost`` rows are registered group members that never arrived.
``finished_attempt``: attempts numbered at or below it are over, so their duplicates are dropped (D8).

Retention (``keyed_books_retention``): reconcile prunes finished rows older than the retention (``books_prune``),
counting each pruned task id by outcome in ``keyed_books_pruned`` in the same statement, and ``books_balance``
adds those counts back, so the books balance over every task id that ever arrived. A pruned task id is forgotten:
a copy of it delivered after that is a new arrival, so the retention must outlast any redelivery (the broker's
visibility timeout, the longest ETA or countdown).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger.attempts import TaskOutcome
from celery_keyed.ledger.clock import NOW
from celery_keyed.ledger.outcome_kinds import NEVER_RAN_KINDS

#: Outcomes of tasks that never ran: their result is stored through the result backend as a failure (D11).
NEVER_RAN: tuple[TaskOutcome, ...] = tuple(kind.outcome for kind in NEVER_RAN_KINDS)

# books_arrive_or_lock: record the arrival of a task id, or lock its existing row, so that two deliveries of one
# task are admitted one after the other (the second sees the first's claim or park: D8). xmax = 0 ⇔ inserted.
BOOKS_ARRIVE_OR_LOCK = sa.text(
    f"""
    INSERT INTO keyed_tasks (task_id, task_name, key, group_key, arrived_at, extra_keys)
    VALUES (:task_id, :task_name, :key, :group_key, {NOW}, CAST(:extra_keys AS text[]))
    ON CONFLICT (task_id) DO UPDATE SET task_id = excluded.task_id
    RETURNING (xmax = 0) AS new, outcome, finished_attempt,
              COALESCE(CAST(:deadline AS timestamptz) <= {NOW}, false) AS expired
    """
)

# books_lock_task: the task's row, first in the lock order: serialises the deliveries, releases, revokes and
# settlements of one task (D1, D8); answers its outcome and last finished attempt.
BOOKS_LOCK_TASK = sa.text(
    "SELECT outcome, finished_attempt, group_key FROM keyed_tasks WHERE task_id = :task_id FOR UPDATE"
)

# books_attempt_is_over: whether an attempt of a task is over (its task finished, or a later attempt ran): its
# shadows are dropped, not made live (D8).
BOOKS_ATTEMPT_IS_OVER = sa.text(
    "SELECT outcome IS NOT NULL OR finished_attempt >= :attempt FROM keyed_tasks WHERE task_id = :task_id"
)

# books_finish: the one final outcome of a task; no row = already recorded (the loser does nothing). ``message``: the
# stored message of a parked task booked never-ran, kept until its result is stored (its canvas context,
# docs/canvas.md).
BOOKS_FINISH = sa.text(
    f"""
    UPDATE keyed_tasks SET outcome = :outcome, finished_at = {NOW}, detail = :detail,
           finished_attempt = GREATEST(finished_attempt, :attempt), message = CAST(:message AS jsonb)
     WHERE task_id = :task_id AND outcome IS NULL
    RETURNING task_id
    """
)

# books_attempt_over: an attempt ended without finishing the task (retry): its duplicates are dropped now.
BOOKS_ATTEMPT_OVER = sa.text(
    "UPDATE keyed_tasks SET finished_attempt = GREATEST(finished_attempt, :attempt) WHERE task_id = :task_id"
)

# books_count_duplicate: a duplicate delivery of a known attempt was acked (D8).
BOOKS_COUNT_DUPLICATE = sa.text("UPDATE keyed_tasks SET duplicates = duplicates + 1 WHERE task_id = :task_id")

# books_revoke_unarrived: a revoke for a task id the ledger has not seen: stored so its arrival is dropped.
BOOKS_REVOKE_UNARRIVED = sa.text(
    f"""
    INSERT INTO keyed_tasks (task_id, arrived_at, outcome, finished_at, detail, notified)
    VALUES (:task_id, {NOW}, 'revoked', {NOW}, 'revoked before arrival', true)
    ON CONFLICT (task_id) DO NOTHING
    """
)

# books_reject_unkeyable: an arrival whose keys cannot be read (a foreign producer's malformed headers) gets its
# one outcome, rejected, without entering admission; its failure result is stored by the caller, which takes the row
# to notify like any (``books_take_unnotified``).
BOOKS_REJECT_UNKEYABLE = sa.text(
    f"""
    INSERT INTO keyed_tasks AS t (task_id, task_name, arrived_at, outcome, finished_at, detail)
    VALUES (:task_id, :task_name, {NOW}, 'rejected', {NOW}, :detail)
    ON CONFLICT (task_id) DO UPDATE
       SET outcome = 'rejected', finished_at = excluded.finished_at, detail = excluded.detail
     WHERE t.outcome IS NULL  -- one outcome per task id
       -- an arrival recorded by an earlier call that committed alone (the fast claim) and then refused: no attempt
       -- of the task lives (a running or parked copy keeps its books; only this copy is refused)
       AND NOT EXISTS (SELECT 1 FROM keyed_claims c WHERE c.task_id = t.task_id)
       AND NOT EXISTS (SELECT 1 FROM keyed_waiting w WHERE w.task_id = t.task_id)
    """
)

# books_take_unnotified: never-ran outcomes whose failure result is not stored yet (D11), locked until the caller's
# transaction ends. The notifier holding a row stores its result and marks it notified before it commits; one running
# at the same time (another thread, another worker) skips the row (SKIP LOCKED), or, when it read the row before the
# commit, finds it notified when it locks it: one result stored, one errback called. A row without a stored message
# (a refusal at arrival) is left to the worker that refused it, which holds the request's context, for ``:grace``
# seconds; after that the sweep stores it from the books.
BOOKS_TAKE_UNNOTIFIED = sa.text(
    f"""
    SELECT task_id, task_name, outcome, detail, message FROM keyed_tasks
     WHERE NOT notified AND outcome = ANY(:outcomes)
       AND (message IS NOT NULL OR finished_at < {NOW} - make_interval(secs => :grace))
     ORDER BY finished_at LIMIT :limit
       FOR UPDATE SKIP LOCKED
    """
)
# books_take_unnotified_ids: the same for the given task ids, at once (the worker that decided their outcome, or
# that stored a revoke), waiting for a row another notifier holds: that notifier commits it notified, and this one
# then passes it by (the row is read again once locked). The caller returns only once their results are stored —
# by it or by another worker (Celery's revoke command, right after, stores REVOKED for a task without a result). In
# task id order, so two such callers never wait for each other in a circle; the sweep never waits.
BOOKS_TAKE_UNNOTIFIED_IDS = sa.text(
    """
    SELECT task_id, task_name, outcome, detail, message FROM keyed_tasks
     WHERE task_id = ANY(:task_ids) AND NOT notified AND outcome = ANY(:outcomes)
     ORDER BY task_id
       FOR UPDATE
    """
)
BOOKS_KNOWN = sa.text("SELECT task_id FROM keyed_tasks WHERE task_id = ANY(:task_ids)")
BOOKS_MARK_NOTIFIED = sa.text(
    "UPDATE keyed_tasks SET notified = true, message = NULL WHERE task_id = ANY(:task_ids) AND NOT notified"
)

# books_record_lost: a registered group number never received gets its one outcome, lost (D10); a task id that
# arrived meanwhile keeps its own row (ON CONFLICT DO NOTHING).
BOOKS_RECORD_LOST = sa.text(
    f"""
    INSERT INTO keyed_tasks (task_id, group_key, arrived_at, outcome, finished_at, detail)
    VALUES (:task_id, :group_key, :registered_at, 'lost', {NOW}, 'registered group number never received')
    ON CONFLICT (task_id) DO NOTHING
    """
)

# books_balance: counts by outcome (NULL = still waiting or running), with the task ids pruned after the retention
# (one statement, one snapshot: a prune deletes and counts in one transaction, so no task id is seen twice or missed).
BOOKS_BALANCE = sa.text(
    """
    SELECT outcome, sum(n) AS n FROM (
        SELECT outcome, count(*) AS n FROM keyed_tasks GROUP BY outcome
        UNION ALL
        SELECT outcome, tasks FROM keyed_books_pruned WHERE tasks > 0
    ) b GROUP BY outcome
    """
)

# books_prune: forget up to :batch finished task ids that finished before now - :retention, oldest first, and count
# them by outcome in keyed_books_pruned in the same statement (the books still balance). Never an open task
# (outcome NULL: waiting, running, between attempts), never a never-ran outcome whose failure result is not stored
# yet (NOT notified, D11), never a task that still has a claim (an uncertain hold), a parked row (a shadow, D8) or a
# group member row. Rows an admission holds locked are skipped (SKIP LOCKED) and pruned by a later run; an
# admission that waits for a pruned row's lock then finds no row and books a new arrival.
BOOKS_PRUNE = sa.text(
    f"""
    WITH gone AS (
        DELETE FROM keyed_tasks t USING (
            SELECT f.task_id FROM keyed_tasks f
             WHERE f.outcome IS NOT NULL AND f.finished_at < {NOW} - make_interval(secs => :retention)
               AND (f.notified OR f.outcome <> ALL(:never_ran))
               AND NOT EXISTS (SELECT 1 FROM keyed_claims c WHERE c.task_id = f.task_id)
               AND NOT EXISTS (SELECT 1 FROM keyed_waiting w WHERE w.task_id = f.task_id)
               AND NOT EXISTS (SELECT 1 FROM keyed_group_members m WHERE m.task_id = f.task_id)
             ORDER BY f.finished_at LIMIT :batch FOR UPDATE SKIP LOCKED) v
         WHERE t.task_id = v.task_id AND t.outcome IS NOT NULL
        RETURNING t.outcome
    ), counted AS (
        INSERT INTO keyed_books_pruned AS p (outcome, tasks)
        SELECT outcome, count(*) FROM gone GROUP BY outcome
        ON CONFLICT (outcome) DO UPDATE SET tasks = p.tasks + excluded.tasks
    )
    SELECT count(*) FROM gone
    """
)


def books_finish(
    conn: sa.Connection,
    task_id: str,
    outcome: TaskOutcome,
    *,
    attempt: int = 0,
    detail: str = "",
    message: Any = None,
    now: datetime | None = None,
) -> bool:
    """Record ``outcome`` as the task's final outcome; False if one was recorded before. ``message``: the stored
    message of a parked task that never ran, kept until its result is stored."""
    params = {
        "task_id": task_id, "outcome": outcome, "attempt": attempt, "detail": detail, "now": now,
        "message": None if message is None else json.dumps(message),
    }
    return conn.execute(BOOKS_FINISH, params).first() is not None


def books_attempt_over(conn: sa.Connection, task_id: str, attempt: int) -> None:
    conn.execute(BOOKS_ATTEMPT_OVER, {"task_id": task_id, "attempt": attempt})


def books_count_duplicate(conn: sa.Connection, task_id: str) -> None:
    conn.execute(BOOKS_COUNT_DUPLICATE, {"task_id": task_id})


def books_balance(conn: sa.Connection) -> dict[str, int]:
    """Counts by outcome of every task id that ever arrived (pruned ones included); key ``"open"`` for tasks still
    waiting or running, ``"arrivals"`` for all but lost."""
    counts = {(row.outcome or "open"): int(row.n) for row in conn.execute(BOOKS_BALANCE)}
    counts["arrivals"] = sum(n for outcome, n in counts.items() if outcome != TaskOutcome.LOST)
    return counts


def books_prune(conn: sa.Connection, *, retention: float, batch: int, now: datetime | None = None) -> int:
    """Prune one batch of finished task ids older than ``retention`` seconds; returns how many."""
    params = {"retention": retention, "batch": batch, "never_ran": list(NEVER_RAN), "now": now}
    return int(conn.execute(BOOKS_PRUNE, params).scalar_one())


def books_take_unnotified(
    conn: sa.Connection,
    task_ids: list[str] | None = None,
    *,
    limit: int = 500,
    grace: float = 0.0,
    now: datetime | None = None,
) -> list[sa.Row[Any]]:
    """Tasks that never ran whose failure result is not stored yet, each locked until the transaction ends.
    ``task_ids``: these, waiting for the ones another transaction holds (the caller bounds the wait: a
    ``lock_timeout``); else the oldest ``limit``, skipping the ones another transaction holds, and rows without a
    stored message only once they are ``grace`` seconds old."""
    outcomes = list(NEVER_RAN)
    if task_ids is not None:
        return list(conn.execute(BOOKS_TAKE_UNNOTIFIED_IDS, {"task_ids": task_ids, "outcomes": outcomes}))
    params = {"limit": limit, "outcomes": outcomes, "grace": grace, "now": now}
    return list(conn.execute(BOOKS_TAKE_UNNOTIFIED, params))


def books_known(conn: sa.Connection, task_ids: list[str]) -> set[str]:
    """Which of these task ids have a row in the books."""
    return set(conn.execute(BOOKS_KNOWN, {"task_ids": task_ids}).scalars())


def books_mark_notified(conn: sa.Connection, task_ids: list[str]) -> None:
    conn.execute(BOOKS_MARK_NOTIFIED, {"task_ids": task_ids})


def books_reject_unkeyable(
    conn: sa.Connection, task_id: str, *, task_name: str, detail: str, now: datetime | None = None
) -> None:
    conn.execute(BOOKS_REJECT_UNKEYABLE, {"task_id": task_id, "task_name": task_name, "detail": detail, "now": now})


# books_open_idle: open tasks with no attempt in the ledger (no claim, no waiting row) that arrived over
# :age seconds ago — between attempts, or lost after their message was acked (D15). Reconcile reads their result
# to settle those whose body ended (books_settle).
BOOKS_OPEN_IDLE = sa.text(
    f"""
    SELECT t.task_id FROM keyed_tasks t
     WHERE t.outcome IS NULL AND t.arrived_at < {NOW} - make_interval(secs => :age)
       AND NOT EXISTS (SELECT 1 FROM keyed_claims c WHERE c.task_id = t.task_id)
       AND NOT EXISTS (SELECT 1 FROM keyed_waiting w WHERE w.task_id = t.task_id)
     ORDER BY t.arrived_at LIMIT :limit
    """
)

# books_settle: the outcome of a task whose body ended but whose release never committed (its worker died after
# the result was stored, D15). Guarded like books_finish, and only while the task has no claim and no waiting row
# (the caller locks the task's row first: an arrival of the task locks it too, so neither misses the other; the
# caller reads the row's group_key under that lock to give a group member's failure as a dead-letter, D11).
BOOKS_SETTLE = sa.text(
    f"""
    UPDATE keyed_tasks t
       SET outcome = :outcome, finished_at = {NOW}, detail = :detail
     WHERE t.task_id = :task_id AND t.outcome IS NULL
       AND NOT EXISTS (SELECT 1 FROM keyed_claims c WHERE c.task_id = t.task_id)
       AND NOT EXISTS (SELECT 1 FROM keyed_waiting w WHERE w.task_id = t.task_id)
    RETURNING t.task_id, t.group_key, t.outcome
    """
)


def books_open_idle(conn: sa.Connection, *, age: float, limit: int = 100, now: datetime | None = None) -> list[str]:
    return list(conn.execute(BOOKS_OPEN_IDLE, {"age": age, "limit": limit, "now": now}).scalars())

