"""Sent: refusal at send (tables ``keyed_sent`` and ``keyed_send_refusals``).

A producer that sends with ``keyed_admit_at_send`` asks the ledger first, in one call of ``keyed_admit_at_send``
(migration 0006): accepted, the task id gets a row in ``keyed_sent`` — its place in the key's waiting room and,
with a ``dedupe_key``, the one live task of that dedupe key — and the message is published; refused, nothing is
published and nothing is booked in ``keyed_tasks`` (the task id never arrived), only a count per name and reason
in ``keyed_send_refusals``.

Rules, both decided inside Postgres under locks (never read in Python and then written):

- **Room.** ``waiting`` of the key + its reservations whose task is neither parked, running nor finished
  (sent, not arrived yet) < ``max_waiting`` of the name (overflow ``reject``), under the key's ``keyed_keys`` row
  lock — the lock every park and promotion of the key takes (lock order 3).
- **Dedupe.** At most one live task per dedupe key (no final outcome; arrived, or sent within the arrival
  timeout), under an advisory transaction lock of the dedupe key that only senders take.

A reservation is recognised by its task id: the worker's arrival needs nothing from it. It stops counting when
the task parks or claims (the same transaction), and is dropped by reconcile (``SENT_DROP_OVER``) once its task
has a final outcome or when it never arrived before its ``expires_at`` (sent + ``keyed_send_arrival_timeout``: a
message lost by the broker gives its place back). Nothing here touches the books, so they balance with or without
refusals.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger.clock import NOW

# sent_admit: the producer's one round trip (keyed_admit_at_send, migration 0006: room and dedupe under locks).
SENT_ADMIT = sa.text(
    """
    SELECT verdict, detail, holder_task_id
      FROM keyed_admit_at_send(:task_id, :key, :name, :dedupe_key, :arrival_timeout, CAST(:now AS timestamptz))
    """
)

# sent_forget: a send accepted but never published (the publish raised): its place is given back at once.
SENT_FORGET = sa.text("DELETE FROM keyed_sent WHERE task_id = :task_id")

# sent_drop_over: reservations that no longer hold anything: their task has a final outcome, or it never arrived
# before its expires_at (the broker lost it, or it was never published). Bounded batch, oldest first.
SENT_DROP_OVER = sa.text(
    f"""
    DELETE FROM keyed_sent s USING (
        SELECT s2.task_id FROM keyed_sent s2 LEFT JOIN keyed_tasks t ON t.task_id = s2.task_id
         WHERE t.outcome IS NOT NULL
            OR (t.task_id IS NULL AND s2.expires_at <= {NOW})
         ORDER BY s2.sent_at LIMIT :batch FOR UPDATE OF s2 SKIP LOCKED) v
     WHERE s.task_id = v.task_id
    RETURNING s.task_id
    """
)

# sent_by_name: per name, the live reservations not yet parked or running (sent, not arrived), and the refusals.
SENT_BY_NAME = sa.text(
    f"""
    SELECT n.name,
           (SELECT count(*) FROM keyed_sent s LEFT JOIN keyed_tasks t ON t.task_id = s.task_id
             WHERE split_part(s.key, ':', 1) = n.name AND t.task_id IS NULL
               AND s.expires_at > {NOW}) AS in_flight,
           COALESCE((SELECT sum(r.refused) FROM keyed_send_refusals r
                      WHERE r.name = n.name AND r.reason = 'room_full'), 0) AS refused_full,
           COALESCE((SELECT sum(r.refused) FROM keyed_send_refusals r
                      WHERE r.name = n.name AND r.reason = 'duplicate'), 0) AS refused_duplicate
      FROM (SELECT split_part(key, ':', 1) AS name FROM keyed_sent
            UNION SELECT name FROM keyed_send_refusals) n
     ORDER BY n.name
    """
)


@dataclass(frozen=True)
class SendVerdict:
    """What ``keyed_admit_at_send`` answered: ``accepted``; else ``reason`` (``room_full`` or ``duplicate``),
    ``detail``, and for a duplicate the live task id holding the dedupe key (``holder_task_id``)."""

    accepted: bool
    reason: str
    detail: str
    holder_task_id: str | None = None


@dataclass(frozen=True)
class SendCounts:
    """One name's sends as operators see them: accepted and not arrived yet, refused for a full room, refused as
    a duplicate (since the ledger was created)."""

    name: str
    in_flight: int
    refused_full: int
    refused_duplicate: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "in_flight": self.in_flight,
            "refused_full": self.refused_full,
            "refused_duplicate": self.refused_duplicate,
        }


def sent_admit(
    conn: sa.Connection,
    task_id: str,
    key: str,
    *,
    dedupe_key: str | None,
    arrival_timeout: float,
    now: datetime | None = None,
) -> SendVerdict:
    """Ask at send whether ``task_id`` may be published under ``key`` (its first concurrency key). Accepted, the
    reservation is written on ``conn`` (commit it before or with the publish)."""
    name = key.split(":", 1)[0]
    params = {
        "task_id": task_id,
        "key": key,
        "name": name,
        "dedupe_key": dedupe_key,
        "arrival_timeout": arrival_timeout,
        "now": now,
    }
    row = conn.execute(SENT_ADMIT, params).one()
    return SendVerdict(row.verdict == "accepted", row.verdict, row.detail or "", row.holder_task_id)


def sent_forget(conn: sa.Connection, task_id: str) -> None:
    conn.execute(SENT_FORGET, {"task_id": task_id})


def sent_drop_over(conn: sa.Connection, *, batch: int = 1000, now: datetime | None = None) -> int:
    """Drop one batch of reservations that hold nothing any more; returns how many."""
    params = {"batch": batch, "now": now}
    return len(conn.execute(SENT_DROP_OVER, params).all())


def sent_by_name(conn: sa.Connection, *, now: datetime | None = None) -> list[SendCounts]:
    rows = conn.execute(SENT_BY_NAME, {"now": now})
    return [SendCounts(r.name, int(r.in_flight), int(r.refused_full), int(r.refused_duplicate)) for r in rows]
