"""Books lost with a failover (D20): arrivals the new server never saw, settled from what survives.

A standby promoted after the primary died lacks the primary's last commits (asynchronous replication). A task that
arrived, ran and finished in that window has no row here at all when its worker died with the primary (a worker
that survives settles its own from its journal: ``worker.failover``). Its result in the result backend survives:
the reconciler (``celery_keyed.lost_books``) reads the results stored around the failover and books each task the
ledger never saw from its final result, through ``keyed_books_settle_from_result`` (migration 0028): one guarded
statement that locks the task's row, writes nothing while an attempt of the task is claimed or waiting, and inserts
the outcome only where the task has none (``ON CONFLICT … WHERE outcome IS NULL``) — so a redelivery, a surviving
worker's journal and several reconcilers racing each other still leave one outcome per task.

Tasks whose books are open here (the arrival replicated, the release did not) need nothing of this module: once no
claim is left (a dead holder's is reclaimed a lease after the hold), reconcile settles them from their result like any
task whose release was lost (``books.BOOKS_OPEN_IDLE``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

# last_failover: when the last failover was detected (its 'failover' event, the latest before its hold's end: read
# backwards on the events' time index, a lease's worth of events at most), and until when it held new starts.
LAST_FAILOVER = sa.text(
    """
    SELECT (SELECT ev.at FROM keyed_events ev WHERE ev.kind = 'failover' AND ev.at <= i.hold_until
             ORDER BY ev.at DESC LIMIT 1) AS at,
           i.hold_until, now() AS now
      FROM keyed_ledger_identity i
     WHERE i.hold_until IS NOT NULL
    """
)

# tasks_never_seen: of these task ids, those with no row in the books (never arrived here, or lost with a failover).
TASKS_NEVER_SEEN = sa.text(
    """
    SELECT t.task_id FROM unnest(CAST(:task_ids AS text[])) AS t(task_id)
     WHERE NOT EXISTS (SELECT 1 FROM keyed_tasks k WHERE k.task_id = t.task_id)
    """
)


# books_settle_from_result: book a lost task from its stored result (keyed_books_settle_from_result); True: recorded.
BOOKS_SETTLE_FROM_RESULT = sa.text(
    "SELECT keyed_books_settle_from_result(:task_id, :attempt, :task_name, :key, :outcome)"
)


@dataclass(frozen=True)
class Failover:
    """The last failover the ledger recorded: detected ``at``, new starts held until ``hold_until``; ``now`` is the
    server's clock when read."""

    at: datetime
    hold_until: datetime
    now: datetime

    @property
    def holding(self) -> bool:
        return self.now < self.hold_until


@dataclass(frozen=True)
class LostArrival:
    """A task the ledger may have lost with a failover, as its stored result tells it: its final ``outcome``
    ('completed', 'failed', or the never-ran outcome of a stored ``Keyed…`` failure), the ``attempt`` that ended it, its
    name and (first) concurrency key."""

    task_id: str
    attempt: int
    task_name: str
    key: str | None
    outcome: str


class LostBooks:
    """The ledger's side of settling the books a failover lost, each call in a transaction of its own."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine

    def last_failover(self) -> Failover | None:
        """The last failover recorded (None: none ever)."""
        with self.engine.connect() as conn:
            row = conn.execute(LAST_FAILOVER).first()
        return None if row is None or row.at is None else Failover(row.at, row.hold_until, row.now)

    def never_seen(self, task_ids: Sequence[str]) -> set[str]:
        """Of ``task_ids``, those the books have no row for."""
        if not task_ids:
            return set()
        with self.engine.connect() as conn:
            return set(conn.execute(TASKS_NEVER_SEEN, {"task_ids": list(task_ids)}).scalars())

    def settle(self, lost: LostArrival) -> bool:
        """Book ``lost``'s outcome unless the task has one, or an attempt of it is claimed or waiting
        (``keyed_books_settle_from_result``); True when this call recorded it."""
        params = {
            "task_id": lost.task_id,
            "attempt": lost.attempt,
            "task_name": lost.task_name,
            "key": lost.key,
            "outcome": lost.outcome,
        }
        with self.engine.begin() as conn:
            return bool(conn.execute(BOOKS_SETTLE_FROM_RESULT, params).scalar())
