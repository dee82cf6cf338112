"""Storing the result of a task that never ran, once (D11).

A never-ran outcome (rejected, expired, superseded, revoked while parked, dead-lettered, lost) is recorded in the
books with ``notified`` false; a worker stores its failure result through the result backend (which calls the
task's errbacks and moves a chord on), then marks it notified. Several notifiers run at once — every worker's
sweep, the loop right after a revoke or a refusal, the heartbeat — so a notifier takes the rows it stores in a
transaction that locks them (``books_take_unnotified``) and marks them notified before it commits:
the sweep of another worker skips them; a notifier of given task ids (the worker that refused a task, or that
stored a revoke) waits for them and finds them notified. A store that fails leaves its row unnotified for the next
sweep; a worker that dies between storing and committing leaves it too, so a result is stored at least once and,
short of such a death, exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger.books import books_known, books_mark_notified, books_take_unnotified

#: Seconds a refusal at arrival (a row without a stored message) is left to the worker that refused it, which holds
#: the request's context (its errbacks, its chord), before the sweep stores it from the books.
ARRIVAL_GRACE = 2.0

#: Most seconds a notifier of given task ids waits for another notifier holding one of their rows (a store takes
#: milliseconds; a result backend that hangs should not hold the consumer loop much longer than that).
HOLD_WAIT = 2.0

LOCK_NOT_AVAILABLE = "55P03"


@dataclass
class NeverRan:
    """Rows taken to notify, held until the ``with`` block ends. ``rows``: locked, not notified yet; ``unknown``:
    asked-for task ids with no row in the books (the caller stores them itself, nobody else will). Asked-for ids in
    neither are another notifier's, or notified already. ``stored(task_id)`` after its result is stored."""

    rows: list[sa.Row[Any]]
    unknown: set[str] = field(default_factory=set)
    done: list[str] = field(default_factory=list)

    def stored(self, task_id: str) -> None:
        self.done.append(task_id)


@contextmanager
def take_never_ran(
    engine: sa.Engine,
    task_ids: list[str] | None = None,
    *,
    limit: int = 500,
    grace: float = ARRIVAL_GRACE,
    wait: float = HOLD_WAIT,
    now: datetime | None = None,
) -> Iterator[NeverRan]:
    """Take the never-ran rows to notify in a transaction held over the ``with`` block; the ones marked ``stored``
    are marked notified when it ends, even when the block raised after storing some.

    ``task_ids``: these rows; one another notifier holds is waited for (at most ``wait`` seconds, then all of them
    are left to the others), and is found notified when it commits. Without: the sweep's oldest ``limit``, never
    waiting (rows another notifier holds are skipped)."""
    with engine.begin() as conn:
        if task_ids is None:
            taken = NeverRan(books_take_unnotified(conn, None, limit=limit, grace=grace, now=now))
        else:
            rows = _take_waiting(conn, task_ids, wait)
            taken = NeverRan(rows or [])
            if rows is not None and len(rows) < len(set(task_ids)):
                missing = sorted(set(task_ids) - {r.task_id for r in rows})
                taken.unknown = set(missing) - books_known(conn, missing)
        try:
            yield taken
        finally:
            if taken.done:
                books_mark_notified(conn, taken.done)


def _take_waiting(conn: sa.Connection, task_ids: list[str], wait: float) -> list[sa.Row[Any]] | None:
    """The rows of ``task_ids`` to notify, waiting at most ``wait`` seconds for another notifier's; None when that
    wait ran out (the other notifier stores them: a store that hangs is not this caller's to repeat)."""
    savepoint = conn.begin_nested()
    try:
        conn.execute(sa.text("SELECT set_config('lock_timeout', :ms, true)"), {"ms": f"{max(1, int(wait * 1000))}ms"})
        rows = books_take_unnotified(conn, task_ids)
    except sa.exc.OperationalError as exc:
        if getattr(exc.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
            raise
        savepoint.rollback()
        return None
    savepoint.commit()  # the lock timeout stays for the transaction: what is left waits for no lock
    return rows
