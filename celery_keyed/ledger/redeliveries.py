"""Redeliveries (D8): an arrival whose attempt token the ledger knows already — its task finished or the attempt is
over, or the attempt holds a claim or waits — is a DUPLICATE, counted in the books; a second delivery of a running
attempt is kept as its shadow (promoted if that attempt's lease is reclaimed, dropped when it finishes). Runs in the
admission's transaction, after the task's row is locked.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import books, claims, groups, keys, waiting
from celery_keyed.ledger.attempts import Admission, Arrival, Verdict


def known_attempt(
    conn: sa.Connection, arrival: Arrival, row: Any, *, name: str | None, now: datetime | None
) -> Admission | None:
    """DUPLICATE when the task finished or this attempt is over, or when its token holds a claim or a waiting row
    already (D8); None: a new attempt."""
    if row.outcome is not None or row.finished_attempt >= arrival.attempt:
        books.books_count_duplicate(conn, arrival.task_id)
        return Admission(Verdict.DUPLICATE, detail=f"finished ({row.outcome or 'attempt over'})")
    token = arrival.token
    held = conn.execute(claims.CLAIMS_TOKEN_STATE, {"task_id": token.task_id, "attempt": token.attempt}).first()
    if held is not None:
        return _duplicate(conn, arrival, held.kind, held.detail, name=name, now=now)
    return None


def _duplicate(
    conn: sa.Connection, arrival: Arrival, kind: str, detail: str, *, name: str | None, now: datetime | None
) -> Admission:
    """A known attempt token arrived again (D8): count it; a duplicate of a running attempt is kept as its
    shadow (promoted if that attempt's lease is reclaimed, dropped when it finishes)."""
    books.books_count_duplicate(conn, arrival.task_id)
    if kind == "claim" and detail in ("running", "uncertain"):
        if arrival.key and name:
            keys.keys_lock(conn, arrival.key, name, now=now)
        inserted = waiting.waiting_insert(
            conn,
            arrival,
            name=name,
            group_seq=None if not arrival.group_key else _member_seq(conn, arrival.task_id),
            shadow=True,
            now=now,
        )
        if inserted is not None and arrival.key:
            keys.keys_add_waiting(conn, arrival.key, force=True)
        return Admission(Verdict.DUPLICATE, detail="shadow of a running attempt")
    return Admission(Verdict.DUPLICATE, detail=f"already {detail}")


def _member_seq(conn: sa.Connection, task_id: str) -> int | None:
    member = groups.members_get(conn, task_id)
    return None if member is None else int(member.seq)
