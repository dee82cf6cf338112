"""Operators' actions and reads that no worker needs (the Django admin, the CLI): a forced release of a claim,
and the per-key overview of the live view. Pure SQLAlchemy Core, like the rest of the ledger.

A forced release goes through the ledger's own fenced release (``release.release``): only the claim held with
exactly this fence is released, so a stale page (the attempt finished, or was reclaimed and claimed again with a
new fence) changes nothing. When the holder is still alive — its lease is current, so its worker is renewing it
and the attempt is probably still executing — freeing its slot lets another attempt start beside it: a deliberate
breach of the bound (DESIGN §3.1), recorded as a ``forced_release`` event, and the attempt is booked ``revoked``
(its worker's heartbeat then learns it lost the slot and self-fences, D7). A claim whose lease has lapsed is
released as the reaper would release it (worker lost: a redelivery may run it again), recorded ``reclaimed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

import sqlalchemy as sa

from celery_keyed.ledger.attempts import Outcome, Promotion, Token
from celery_keyed.ledger.claims import CLAIMS_GET_FENCED
from celery_keyed.ledger.events import events_record
from celery_keyed.ledger.promote import DEFAULT_DISPATCH_TIMEOUT
from celery_keyed.ledger.release import release


@dataclass
class ForcedRelease:
    """What a forced release did: ``released`` False means the fence was stale (nothing changed);
    ``breach`` says the holder was alive (a recorded breach of the bound)."""

    released: bool
    breach: bool = False
    detail: str = ""
    promotions: list[Promotion] = field(default_factory=list)


def force_release(
    conn: sa.Connection,
    token: Token,
    fence: int,
    *,
    reason: str,
    author: str = "",
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: datetime | None = None,
) -> ForcedRelease:
    """Release the claim of ``token`` held with ``fence`` on an operator's order, in the caller's transaction.
    Returns the promotions the freed slot made (the caller dispatches them after commit)."""
    if not reason or not reason.strip():
        raise ValueError("a forced release needs a reason")
    claim = conn.execute(
        CLAIMS_GET_FENCED, {"task_id": token.task_id, "attempt": token.attempt, "fence": fence, "now": now}
    ).first()
    if claim is None or claim.state != "running":
        return ForcedRelease(False, detail="no running claim with this fence (already released or claimed again)")
    breach = bool(claim.live)
    who = f"by {author}" if author else "by an operator"
    detail = f"force-released {who}: {reason.strip()}"
    outcome = Outcome.REVOKED if breach else Outcome.WORKER_LOST
    report = release(conn, token, fence, outcome, detail=detail, dispatch=dispatch, now=now)
    if not report.released:  # lost the race for the row to its worker or the reaper: nothing was ours to do
        return ForcedRelease(False, detail="released meanwhile by its worker or the reaper")
    events_record(
        conn,
        "forced_release" if breach else "reclaimed",
        key=claim.key or claim.group_key,
        task_id=token.task_id,
        detail=f"{detail} (attempt {token.attempt}, fence {fence}, holder {claim.holder}"
        + (", alive: the bound was breached)" if breach else ", lease lapsed)"),
        now=now,
    )
    return ForcedRelease(True, breach=breach, detail=detail, promotions=list(report.promotions))
