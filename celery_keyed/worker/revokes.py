"""Revoke commands: Celery's ``revoke`` / ``terminate`` broadcasts stored in the ledger (D11).

A parked task's message lives in the ledger and in no worker's memory, so Celery's in-memory revoke list never
reaches it: the bootstep wraps Celery's revoke commands (``bootstep.wrap_revoke_commands``) to call
``Revokes.record`` first, which stores each revoke in the ledger so that the parked task leaves the waiting room
with outcome ``revoked`` (and its group moves on). Every worker gets the broadcast: the first transaction to lock
the task's row takes its parked rows, the others find none (idempotent). With the ledger unreachable the revokes
are kept in ``pending`` and stored by the heartbeat once it is back (``flush_pending``).

Threads and fields: ``record`` runs on the consumer loop (Celery's control commands run there); ``pending`` is
appended by the loop and popped by the heartbeat (a deque: thread-safe ends). No thread of its own.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import LedgerError

logger = logging.getLogger("celery_keyed")

#: Revokes of one broadcast stored on the consumer loop; the rest go to ``pending``.
ON_LOOP = 32
#: Pending revokes the heartbeat stores per beat.
FLUSH_BUDGET = 128


class Revokes:
    """The revokes of one gate."""

    def __init__(
        self,
        *,
        ledger: Any,
        breaker: Any,
        dispatch: Callable[..., None],
        notify_never_ran: Callable[[list[str]], None],
    ) -> None:
        self.ledger = ledger
        self.breaker = breaker
        self.dispatch = dispatch  # the handoff's dispatch of promotions
        self.notify_never_ran = notify_never_ran  # the sweeper's: store the results of these tasks that never ran
        self.pending: deque[str] = deque()  # revokes not yet stored (ledger unreachable)

    def record(self, task_ids: Iterable[str]) -> None:
        """Consumer loop: store each revoke in the ledger, then store the ``KeyedRevoked`` results. This is the
        one ledger call left on the consumer loop (a control command, not the task path): Celery's handler,
        right after it, stores REVOKED for a task it does not know, so ours must come first; Celery's handler
        leaves a finished result alone."""
        ids = [str(task_id) for task_id in task_ids]
        if not ids:
            return
        # A transaction each: a broadcast of thousands would hold the loop for seconds. The first ON_LOOP are stored
        # now; the rest by the heartbeat, FLUSH_BUDGET per beat (meanwhile every worker's own revoked list, which
        # Celery's handler fills next, keeps them from starting).
        ids, later = ids[:ON_LOOP], ids[ON_LOOP:]
        if later:
            logger.warning(
                "celery-keyed: a revoke of %d tasks: %d are stored in the ledger by the heartbeat",
                len(ids) + len(later), len(later),
            )  # fmt: skip
        if self.breaker.is_open:
            self.pending.extend([*ids, *later])
            return
        self.pending.extend(later)
        try:
            self._store(ids, local=True)
        except sa.exc.OperationalError as exc:
            self.breaker.open(exc)
            self.pending.extend(ids)

    def _store(self, task_ids: list[str], *, local: bool) -> None:
        """Store each revoke; one the ledger refuses for its value (a foreign task id it cannot hold: over 255
        characters' index row, a NUL) is logged and dropped, and never keeps the others from being stored. Celery's
        own in-memory revoke still applies to it. An unreachable ledger raises (the caller keeps the rest)."""
        stored = []
        for task_id in task_ids:  # a revoked group member: its group moves on (its promotions)
            try:
                promotions = self.ledger.revoke(task_id)
            except (sa.exc.DataError, sa.exc.IntegrityError, sa.exc.ProgrammingError, LedgerError) as exc:
                logger.error("celery-keyed: the ledger refused the revoke of %r: %s", task_id[:300], exc)
                continue
            stored.append(task_id)
            self.dispatch(promotions, local=local)
        # Their KeyedRevoked results, before Celery's handler runs: it stores REVOKED for a task without a result.
        # Another worker storing one of them (the broadcast reaches every worker) is waited for.
        if stored:
            self.notify_never_ran(stored)

    def flush_pending(self, budget: int | None = None) -> None:
        """Heartbeat thread: store the revokes received while the ledger was unreachable, or beyond what one
        broadcast stores on the loop; at most ``budget`` (``FLUSH_BUDGET``) per call, so that a long list never
        delays the renewal of leases for long. (The loop only appends to ``pending``; this thread pops.)"""
        chunk: list[str] = []
        for _ in range(FLUSH_BUDGET if budget is None else budget):
            try:
                chunk.append(self.pending.popleft())  # atomic; the loop may append meanwhile (never iterate it)
            except IndexError:
                break
        if not chunk:
            return
        try:
            self._store(chunk, local=False)
        except sa.exc.DBAPIError:
            self.pending.extendleft(reversed(chunk))  # unreachable: all of them again next time, first in line
