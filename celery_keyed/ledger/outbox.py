"""Outbox: keyed messages registered at publish (table ``keyed_outbox``, migration 0008).

A producer with ``keyed_register_at_publish`` stores each keyed message here when it publishes it — in the caller's
transaction when one is given (then the relay publishes it once that transaction has committed), else in a
transaction of its own, committed before the publish. A row lives until its task's arrival is recorded: the trigger
``keyed_tasks_outbox_received`` deletes it in the statement that inserts the task's ``keyed_tasks`` row, whichever
path records the arrival. A row still here when it is due was not received by any worker (the broker lost it, or
it is late): ``outbox_take_due`` hands it to the relay, which publishes the stored copy again. If the first copy was
only late, the second is a duplicate of a received task, and the worker drops it (D8: the same attempt token).

A keyed retry is registered too (migration 0023), keyed by the attempt it starts (``attempt`` = its retry number;
0 for a first publish): its row goes when that attempt arrives (``keyed_outbox_attempt_arrived``, on the claim or
waiting row the arrival inserts), or when the task is over otherwise (finished, or a later attempt ended). With the
outbox on for the task it keeps a copy the relay publishes again, like a lost first publish; without it, no copy
(``message`` NULL): the relay skips it and reconcile reports it when it is overdue (``outbox_retries_missing``).

Nothing here touches the books: a registered task enters them when it arrives, like any other task.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

from celery_keyed.ledger.clock import NOW

# outbox_register: store a task's message at publish. A task id that already arrived (it is in the books) is not
# registered (its new message is a retry or a re-send: D8 decides what it is, nothing is left to deliver), nor one
# registered already (a re-send of a pending registration keeps the first copy). due_at: now for a registration the
# relay must publish (pending: made in the caller's transaction), else the expected arrival + the arrival timeout.
OUTBOX_REGISTER = sa.text(
    f"""
    INSERT INTO keyed_outbox (task_id, task_name, key, group_key, message, registered_at, due_at, pending)
    SELECT :task_id, :task_name, :key, :group_key, :message, {NOW},
           CASE WHEN :pending THEN {NOW}
                ELSE GREATEST({NOW}, COALESCE(CAST(:eta AS timestamptz), {NOW}))
                     + make_interval(secs => :arrival_timeout) END,
           :pending
     WHERE NOT EXISTS (SELECT 1 FROM keyed_tasks t WHERE t.task_id = :task_id)
    ON CONFLICT (task_id) DO NOTHING
    RETURNING task_id
    """
).bindparams(sa.bindparam("message", type_=JSONB))

# A retry's registration (row o, attempt > 0) is over: its attempt (or a later one) arrived — a claim or a waiting
# row of it exists, or the task's last finished attempt is at or past it — or the task is no longer open in the books
# (finished, or pruned). A retry of a finished task is dropped by the worker, so nothing is left to deliver.
RETRY_OVER = """(
    NOT EXISTS (SELECT 1 FROM keyed_tasks t
                 WHERE t.task_id = o.task_id AND t.outcome IS NULL AND t.finished_attempt < o.attempt)
    OR EXISTS (SELECT 1 FROM keyed_claims c WHERE c.task_id = o.task_id AND c.attempt >= o.attempt)
    OR EXISTS (SELECT 1 FROM keyed_waiting w WHERE w.task_id = o.task_id AND w.attempt >= o.attempt))"""

# outbox_register_retry: register retry number :attempt of a task that is open in the books, before its message is
# published (its own transaction, committed first: the attempt cannot arrive before its row exists). :message is
# its copy, or NULL (no outbox for the task: a row to report, nothing to republish). A row of an earlier attempt
# (left over: that attempt arrived by a path that inserts no claim) is replaced; a row of this attempt or a later
# one is kept (a re-send keeps the first copy). Due at the expected arrival (the later of now and its ETA, the
# retry's countdown) + the arrival timeout.
OUTBOX_REGISTER_RETRY = sa.text(
    f"""
    INSERT INTO keyed_outbox AS x (task_id, task_name, key, group_key, message, registered_at, due_at, pending,
                                   attempt)
    SELECT :task_id, :task_name, :key, :group_key, :message, {NOW},
           GREATEST({NOW}, COALESCE(CAST(:eta AS timestamptz), {NOW})) + make_interval(secs => :arrival_timeout),
           false, :attempt
     WHERE EXISTS (SELECT 1 FROM keyed_tasks t
                    WHERE t.task_id = :task_id AND t.outcome IS NULL AND t.finished_attempt < :attempt)
       AND NOT EXISTS (SELECT 1 FROM keyed_claims c WHERE c.task_id = :task_id AND c.attempt >= :attempt)
       AND NOT EXISTS (SELECT 1 FROM keyed_waiting w WHERE w.task_id = :task_id AND w.attempt >= :attempt)
    ON CONFLICT (task_id) DO UPDATE
       SET task_name = excluded.task_name, key = excluded.key, group_key = excluded.group_key,
           message = excluded.message, registered_at = excluded.registered_at, due_at = excluded.due_at,
           pending = false, republished = 0, republished_at = NULL, attempt = excluded.attempt, reported = false
     WHERE x.attempt < excluded.attempt
    RETURNING task_id
    """
).bindparams(sa.bindparam("message", type_=JSONB(none_as_null=True)))  # None: SQL NULL (no copy), not JSON null

# outbox_retries_over: drop up to :batch retry registrations that are over (RETRY_OVER; reconcile's cleanup of rows
# whose attempt ended the task without a claim, and of rows without a copy, which the relay never takes).
OUTBOX_RETRIES_OVER = sa.text(
    f"""
    DELETE FROM keyed_outbox x USING (
        SELECT o.task_id FROM keyed_outbox o WHERE o.attempt > 0 AND {RETRY_OVER}
         ORDER BY o.due_at LIMIT :batch FOR UPDATE OF o SKIP LOCKED) v
     WHERE x.task_id = v.task_id
    RETURNING x.task_id
    """
)

# outbox_retries_missing: retry registrations whose attempt is overdue and has not arrived: past their due time, or
# published again by the relay already (which moved the due time on). Each is flagged reported once (first = this
# call flagged it: the caller logs it and records a 'retry_missing' event); all are counted.
OUTBOX_RETRIES_MISSING = sa.text(
    f"""
    WITH missing AS (
        SELECT o.task_id, o.reported FROM keyed_outbox o
         WHERE o.attempt > 0 AND (o.due_at <= {NOW} OR o.republished > 0) AND NOT {RETRY_OVER}
         ORDER BY o.due_at LIMIT :batch FOR UPDATE OF o SKIP LOCKED
    )
    UPDATE keyed_outbox x SET reported = true FROM missing
     WHERE x.task_id = missing.task_id
    RETURNING x.task_id, x.task_name, x.key, x.group_key, x.attempt, x.message IS NOT NULL AS has_copy,
              x.republished, NOT missing.reported AS first
    """
)

# outbox_take_due: the relay's one statement. Due rows, oldest first, each taken by one relay at a time (SKIP
# LOCKED: relays in several workers and beats never publish one row twice per period); a retry's row without a copy
# is never taken. A row whose task is in the books (a retry's: whose attempt is over, RETRY_OVER) is dropped
# (received; normally the trigger did it already). Every other row is handed back to publish, with
# its next due time pushed out (the arrival timeout, doubled with each republish, at most 16 times it, so a queue nobody
# consumes does not fill with copies; a task of an ordered group: its own timeout, shorter than the group's arrival
# timeout), its count raised unless this is the first publish of a pending registration.
# The row is given back in this statement's commit, before the publish: a relay that dies before publishing leaves
# the row due again at its next due time (at least once; a duplicate is dropped by D8).
OUTBOX_TAKE_DUE = sa.text(
    f"""
    WITH due AS (
        SELECT o.task_id, o.pending AS was_pending,
               CASE WHEN o.attempt = 0 THEN EXISTS (SELECT 1 FROM keyed_tasks t WHERE t.task_id = o.task_id)
                    ELSE {RETRY_OVER} END AS received
          FROM keyed_outbox o
         WHERE o.due_at <= {NOW} AND o.message IS NOT NULL
         ORDER BY o.due_at LIMIT :batch
           FOR UPDATE OF o SKIP LOCKED
    ), dropped AS (
        DELETE FROM keyed_outbox o USING due WHERE o.task_id = due.task_id AND due.received RETURNING o.task_id
    )
    UPDATE keyed_outbox o
       SET due_at = {NOW} + make_interval(
               secs => CASE WHEN o.group_key IS NULL THEN :arrival_timeout ELSE :grouped_timeout END
                       * power(2, LEAST(o.republished + CASE WHEN o.pending THEN 0 ELSE 1 END, 4))),
           republished = o.republished + CASE WHEN o.pending THEN 0 ELSE 1 END,
           republished_at = CASE WHEN o.pending THEN o.republished_at ELSE {NOW} END,
           pending = false
      FROM due
     WHERE o.task_id = due.task_id AND NOT due.received
    RETURNING o.task_id, o.task_name, o.message, o.republished, NOT due.was_pending AS republish
    """
)

# outbox_forget: a registration whose first publish must not happen after all (tests; an operator's cleanup).
OUTBOX_FORGET = sa.text("DELETE FROM keyed_outbox WHERE task_id = :task_id")

# outbox_by_name: per name (of the first key, else of the group key), the registrations with a copy not received
# yet (a retry without one is reconcile's to report, not the outbox's), how many of them the relay published again,
# and the oldest registration.
OUTBOX_BY_NAME = sa.text(
    """
    SELECT split_part(COALESCE(key, group_key), ':', 1) AS name, count(*) AS not_received,
           count(*) FILTER (WHERE pending) AS pending,
           count(*) FILTER (WHERE republished > 0) AS republished_tasks,
           COALESCE(sum(republished), 0) AS republished, min(registered_at) AS oldest
      FROM keyed_outbox WHERE message IS NOT NULL GROUP BY 1 ORDER BY 1
    """
)

# outbox_get: one task's registration (explain).
OUTBOX_GET = sa.text(
    "SELECT task_id, task_name, key, group_key, registered_at, due_at, pending, republished, republished_at, attempt"
    " FROM keyed_outbox WHERE task_id = :task_id"
)


@dataclass(frozen=True)
class OutboxDue:
    """A registered message to publish: ``republish`` False for the first publish of a registration made in a
    caller's transaction (pending), True when no worker received an earlier copy; ``republished`` counts them."""

    task_id: str
    task_name: str
    message: dict[str, Any]
    republished: int
    republish: bool


@dataclass(frozen=True)
class OutboxCounts:
    """One name's registrations not received yet: ``pending`` not published yet (a caller's transaction), of which
    ``republished_tasks`` were published again ``republished`` times in all; ``oldest`` registration."""

    name: str
    not_received: int
    pending: int
    republished_tasks: int
    republished: int
    oldest: Any

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "not_received": self.not_received,
            "pending": self.pending,
            "republished_tasks": self.republished_tasks,
            "republished": self.republished,
            "oldest": self.oldest.isoformat() if self.oldest is not None else None,
        }


def outbox_register(
    conn: sa.Connection,
    task_id: str,
    message: dict[str, Any],
    *,
    task_name: str = "",
    key: str | None = None,
    group_key: str | None = None,
    pending: bool = False,
    eta: Any = None,
    arrival_timeout: float = 3600.0,
    now: datetime | None = None,
) -> bool:
    """Store ``task_id``'s message on ``conn`` (commit it before publishing, or leave it ``pending`` for the relay).
    True when stored; False when the task id had arrived already or was registered already."""
    params = {
        "task_id": task_id,
        "task_name": task_name,
        "key": key,
        "group_key": group_key,
        "message": message,
        "pending": pending,
        "eta": eta,
        "arrival_timeout": arrival_timeout,
        "now": now,
    }
    return conn.execute(OUTBOX_REGISTER, params).first() is not None


def outbox_register_retry(
    conn: sa.Connection,
    task_id: str,
    attempt: int,
    message: dict[str, Any] | None,
    *,
    task_name: str = "",
    key: str | None = None,
    group_key: str | None = None,
    eta: Any = None,
    arrival_timeout: float = 3600.0,
    now: datetime | None = None,
) -> bool:
    """Register retry number ``attempt`` of ``task_id`` (commit it before publishing): with its ``message`` (the
    relay publishes it again if the attempt does not arrive in time) or None (reconcile only reports it). True when
    stored; False when the task is not open in the books, the attempt arrived already, or a row of this attempt (or
    a later one) exists."""
    if attempt < 1:
        raise ValueError(f"a retry's attempt is 1 or more, not {attempt!r}")
    params = {
        "task_id": task_id,
        "attempt": attempt,
        "task_name": task_name,
        "key": key,
        "group_key": group_key,
        "message": message,
        "eta": eta,
        "arrival_timeout": arrival_timeout,
        "now": now,
    }
    return conn.execute(OUTBOX_REGISTER_RETRY, params).first() is not None


@dataclass(frozen=True)
class MissingRetry:
    """A retry whose attempt has not arrived by its due time: ``has_copy`` when the outbox keeps its message (the
    relay publishes it again, ``republished`` times so far), else only reported; ``first`` when this is the first
    time it is reported."""

    task_id: str
    task_name: str
    key: str | None
    group_key: str | None
    attempt: int
    has_copy: bool
    republished: int
    first: bool


def outbox_retries_over(conn: sa.Connection, *, batch: int = 500) -> int:
    """Drop one batch of retry registrations whose attempt is over; returns how many."""
    return len(conn.execute(OUTBOX_RETRIES_OVER, {"batch": batch}).all())


def outbox_retries_missing(
    conn: sa.Connection, *, batch: int = 500, now: datetime | None = None
) -> list[MissingRetry]:
    """Retries overdue and not arrived (at most ``batch``), each flagged reported (``first`` the first time)."""
    return [
        MissingRetry(r.task_id, r.task_name, r.key, r.group_key, int(r.attempt), bool(r.has_copy),
                     int(r.republished), bool(r.first))
        for r in conn.execute(OUTBOX_RETRIES_MISSING, {"batch": batch, "now": now})
    ]


def outbox_take_due(
    conn: sa.Connection,
    *,
    arrival_timeout: float,
    grouped_timeout: float | None = None,
    batch: int = 100,
    now: datetime | None = None,
) -> list[OutboxDue]:
    """Take one batch of due registrations to publish (commit before publishing them). Each is due again after
    ``arrival_timeout`` (``grouped_timeout`` for a task of an ordered group), doubled with every republish."""
    grouped = arrival_timeout if grouped_timeout is None else grouped_timeout
    params = {"arrival_timeout": arrival_timeout, "grouped_timeout": grouped, "batch": batch, "now": now}
    return [
        OutboxDue(r.task_id, r.task_name, r.message, int(r.republished), bool(r.republish))
        for r in conn.execute(OUTBOX_TAKE_DUE, params)
    ]


def outbox_forget(conn: sa.Connection, task_id: str) -> None:
    conn.execute(OUTBOX_FORGET, {"task_id": task_id})


def outbox_by_name(conn: sa.Connection) -> list[OutboxCounts]:
    return [
        OutboxCounts(r.name, int(r.not_received), int(r.pending), int(r.republished_tasks), int(r.republished),
                     r.oldest)
        for r in conn.execute(OUTBOX_BY_NAME)
    ]


def outbox_get(conn: sa.Connection, task_id: str) -> dict[str, Any] | None:
    row = conn.execute(OUTBOX_GET, {"task_id": task_id}).mappings().first()
    return None if row is None else dict(row)
