"""Revoke: a revoke stored in the ledger (D11: Celery's in-memory revoke list expires after hours)."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa

from celery_keyed.ledger import books, claims, keys, waiting
from celery_keyed.ledger.attempts import Outcome, Promotion, TaskOutcome, Token
from celery_keyed.ledger.keyspec import key_name
from celery_keyed.ledger.outcomes import finish_never_ran
from celery_keyed.ledger.promote import DEFAULT_DISPATCH_TIMEOUT, give_back_reserved, promote_freed
from celery_keyed.ledger.release import after_claim_removed


def revoke(
    conn: sa.Connection, task_id: str, *, dispatch: float = DEFAULT_DISPATCH_TIMEOUT, now: datetime | None = None
) -> list[Promotion]:
    """Store a revoke in the ledger (Celery's in-memory revoke list expires, D11): parked attempts leave the
    waiting room with outcome ``revoked``; a promotion not yet bound is taken back (its slots go to the next
    waiters); a task between attempts (a retry in transit or waiting for its countdown in a worker) is booked
    revoked, so the attempt is dropped when it arrives; an unseen task id is recorded likewise. Running attempts
    are revoked by Celery and released by their worker with ``Outcome.REVOKED``. All under the task's row lock
    (first in the lock order), which every claim, park and release of the task takes too."""
    locked = conn.execute(books.BOOKS_LOCK_TASK, {"task_id": task_id}).first()
    if locked is None:
        conn.execute(books.BOOKS_REVOKE_UNARRIVED, {"task_id": task_id, "now": now})
        return []
    if locked.outcome is not None:
        return []
    rows = conn.execute(waiting.WAITING_DELETE_TASK, {"task_id": task_id}).all()
    if not rows:
        held = conn.execute(claims.CLAIMS_OF_TASK, {"task_id": task_id}).all()
        unbound = conn.execute(claims.CLAIMS_DELETE_UNBOUND_OF_TASK, {"task_id": task_id}).all()
        if unbound:
            promotions: list[Promotion] = []
            for row in unbound:
                promotions += after_claim_removed(
                    conn, row, Outcome.REVOKED, detail="revoked before it was picked up", dispatch=dispatch, now=now
                ).promotions
            return promotions
        if held:
            return []  # running (or its slots held after it ended): its worker releases it
        return finish_never_ran(
            conn,
            Token(task_id, int(locked.finished_attempt) + 1),
            TaskOutcome.REVOKED,
            detail="revoked between attempts",
            dispatch=dispatch,
            now=now,
        )
    freed = [fr for r in rows for fr in give_back_reserved(conn, r, now=now)]
    for r in rows:
        if r.key is not None:
            keys.keys_lock(conn, r.key, key_name(r.key), now=now)
            keys.keys_remove_waiting(conn, r.key, now=now)
    promotions = promote_freed(conn, freed, dispatch=dispatch, now=now)
    return promotions + finish_never_ran(
        conn,
        Token(task_id, rows[0].attempt),
        TaskOutcome.REVOKED,
        detail="revoked while waiting",
        dispatch=dispatch,
        message=rows[0].message,
        now=now,
    )
