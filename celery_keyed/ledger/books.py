"""The books: one row per task id that arrived (table ``keyed_tasks``), and its one final outcome (D11).

Invariant: a task's outcome is recorded exactly once — ``books_finish`` is guarded by ``outcome IS NULL`` and
its row count is the answer. completed + failed + dead_lettered + expired + rejected + superseded + revoked +
still open (outcome NULL) = arrivals; ``lost`` rows are registered group members that never arrived.
``finished_attempt``: attempts numbered at or below it are over, so their duplicates are dropped (D8).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger.clock import NOW

#: Outcomes of tasks that never ran: their result is stored through the result backend as a failure (D11).
NEVER_RAN = ("dead_lettered", "expired", "rejected", "superseded", "revoked", "lost")

# books_arrive: record an arrival (first attempt seen of a task id); later attempts find the row.
BOOKS_ARRIVE = sa.text(
    f"""
    INSERT INTO keyed_tasks (task_id, task_name, key, group_key, arrived_at)
    VALUES (:task_id, :task_name, :key, :group_key, {NOW})
    ON CONFLICT (task_id) DO NOTHING
    """
)

# books_finish: the one final outcome of a task; no row = already recorded (the loser does nothing).
BOOKS_FINISH = sa.text(
    f"""
    UPDATE keyed_tasks SET outcome = :outcome, finished_at = {NOW}, detail = :detail,
           finished_attempt = GREATEST(finished_attempt, :attempt)
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
# one outcome, rejected, without entering admission; its failure result is stored by the caller (notified).
BOOKS_REJECT_UNKEYABLE = sa.text(
    f"""
    INSERT INTO keyed_tasks (task_id, task_name, arrived_at, outcome, finished_at, detail, notified)
    VALUES (:task_id, :task_name, {NOW}, 'rejected', {NOW}, :detail, true)
    ON CONFLICT (task_id) DO NOTHING
    """
)

# books_unnotified: never-ran outcomes whose failure result is not stored yet (D11).
BOOKS_UNNOTIFIED = sa.text(
    """
    SELECT task_id, task_name, outcome, detail FROM keyed_tasks
     WHERE NOT notified AND outcome = ANY(:outcomes)
     ORDER BY finished_at LIMIT :limit
    """
)
BOOKS_MARK_NOTIFIED = sa.text("UPDATE keyed_tasks SET notified = true WHERE task_id = ANY(:task_ids)")

# books_balance: counts by outcome (NULL = still waiting or running).
BOOKS_BALANCE = sa.text("SELECT outcome, count(*) AS n FROM keyed_tasks GROUP BY outcome")


def books_arrive(
    conn: sa.Connection, task_id: str, *, task_name: str, key: str | None, group_key: str | None, now: Any
) -> None:
    conn.execute(
        BOOKS_ARRIVE,
        {"task_id": task_id, "task_name": task_name, "key": key, "group_key": group_key, "now": now},
    )


def books_finish(
    conn: sa.Connection, task_id: str, outcome: str, *, attempt: int = 0, detail: str = "", now: Any = None
) -> bool:
    """Record ``outcome`` as the task's final outcome; False if one was recorded before."""
    params = {"task_id": task_id, "outcome": outcome, "attempt": attempt, "detail": detail, "now": now}
    return conn.execute(BOOKS_FINISH, params).first() is not None


def books_attempt_over(conn: sa.Connection, task_id: str, attempt: int) -> None:
    conn.execute(BOOKS_ATTEMPT_OVER, {"task_id": task_id, "attempt": attempt})


def books_count_duplicate(conn: sa.Connection, task_id: str) -> None:
    conn.execute(BOOKS_COUNT_DUPLICATE, {"task_id": task_id})


def books_balance(conn: sa.Connection) -> dict[str, int]:
    """Counts by outcome; key ``"open"`` for tasks still waiting or running, ``"arrivals"`` for all but lost."""
    counts = {(row.outcome or "open"): int(row.n) for row in conn.execute(BOOKS_BALANCE)}
    counts["arrivals"] = sum(n for outcome, n in counts.items() if outcome != "lost")
    return counts


def books_unnotified(conn: sa.Connection, limit: int = 500) -> list[sa.Row[Any]]:
    """Tasks that never ran and whose failure result has not been stored yet."""
    return list(conn.execute(BOOKS_UNNOTIFIED, {"limit": limit, "outcomes": list(NEVER_RAN)}))


def books_mark_notified(conn: sa.Connection, task_ids: list[str]) -> None:
    conn.execute(BOOKS_MARK_NOTIFIED, {"task_ids": task_ids})


def books_reject_unkeyable(conn: sa.Connection, task_id: str, *, task_name: str, detail: str, now: Any = None) -> None:
    conn.execute(BOOKS_REJECT_UNKEYABLE, {"task_id": task_id, "task_name": task_name, "detail": detail, "now": now})
