"""Newest wins (``on_newer="cancel_running"``): an arrival asks for the cancellation of the older attempts of its
first key and supersede key that hold a slot, in its own admission transaction, and takes the requests back when it
is refused after all. The claims' side (the request, its withdrawal, the holder's look at it) is ``claims``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa

from celery_keyed.ledger import claims
from celery_keyed.ledger.attempts import Arrival

#: What a newest-wins arrival asked: (task id, attempt, holder) of each attempt whose cancellation it requested.
Cancels = tuple[tuple[str, int, str | None], ...]


def cancel_older(
    conn: sa.Connection, arrival: Arrival, *, now: datetime | None
) -> tuple[tuple[str, int, str | None], ...]:
    """Newest wins (``on_newer="cancel_running"``): ask for the cancellation of the attempts of the
    arrival's first key and supersede key that hold a slot, in the arrival's transaction: the request commits with
    the arrival's claim or park, or not at all. The UPDATE waits for a release of that claim in progress: an attempt
    that released first has no row and is not cancelled. The newest itself is admitted or parked as any arrival: it
    starts only when the bound lets it (on a mutex, when the cancelled attempt's release promotes it)."""
    if arrival.on_newer is None or arrival.key is None or arrival.supersede_key is None:
        return ()
    return tuple(
        claims.claims_request_cancel(
            conn,
            key=arrival.key,
            supersede_key=arrival.supersede_key,
            task_id=arrival.task_id,
            detail=_cancel_detail(arrival),
            now=now,
        )
    )


def _cancel_detail(arrival: Arrival) -> str:
    return f"superseded by {arrival.task_id} (newest wins)"


def withdraw_cancels(conn: sa.Connection, arrival: Arrival, cancels: Sequence[tuple[str, int, str | None]]) -> None:
    """A newest that is refused after all (its waiting room is full of other work) cancels nothing: the requests it
    made in this transaction (rows it holds locked) are taken back."""
    for task_id, attempt, _ in cancels:
        conn.execute(
            claims.CLAIMS_WITHDRAW_CANCEL,
            {"task_id": task_id, "attempt": attempt, "detail": _cancel_detail(arrival)},
        )
