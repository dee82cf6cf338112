"""The reconciler beat task ``celery_keyed.reconcile`` (registered by ``install(app)``): reclaim dead leases,
void stuck promotions, sweep, check counters against claims, drop idle keys, prune the books after
``keyed_books_retention``, publish the outbox's due messages. Safe in several beats at once."""

from __future__ import annotations

import logging
import time
from typing import Any

from celery_keyed import metrics
from celery_keyed.access import dispatch, publisher_for
from celery_keyed.ledger import Ledger
from celery_keyed.lost_books import settle_lost_arrivals
from celery_keyed.publisher import arrival_timeout, relay_outbox

logger = logging.getLogger("celery_keyed")

RECONCILE_TASK = "celery_keyed.reconcile"

#: When this process last failed to reach the ledger (monotonic): leases are only reclaimed by a reconciler
#: that has reached the ledger for a full lease since (D7).
_last_unreachable = time.monotonic()


def reconcile(app: Any) -> dict[str, Any]:
    global _last_unreachable
    publisher = publisher_for(app, required=True)  # a configuration error says what is wrong
    assert publisher is not None
    settings = publisher.settings
    ledger = publisher.ledger
    try:
        if time.monotonic() - _last_unreachable < settings.lease:
            report = ledger.sweep(
                group_arrival_timeout=settings.group_arrival_timeout, reserve_timeout=settings.reserve_timeout
            )
            if settings.books_retention is not None:  # pruning finished rows needs no full lease of reachability
                report.pruned = ledger.prune_books(settings.books_retention)
            reclaim = "skipped (ledger reachable for less than a lease)"
        else:
            report = ledger.reconcile(
                idle=settings.idle_key_ttl,
                group_arrival_timeout=settings.group_arrival_timeout,
                reserve_timeout=settings.reserve_timeout,
                books_retention=settings.books_retention,
            )
            reclaim = f"{len(report.reclaimed)} reclaimed"
    except Exception:
        _last_unreachable = time.monotonic()
        raise
    dispatch(app, report.promotions)
    settled = settle_from_results(app, ledger, age=settings.lease)
    lost = settle_lost_arrivals(app, ledger, retention=settings.books_retention)
    outbox = relay_outbox(
        app,
        ledger,
        arrival_timeout=arrival_timeout(settings, grouped=False),
        grouped_timeout=arrival_timeout(settings, grouped=True),
    )
    metrics.drift_repaired(report.drift)
    if report.drift:
        logger.error("celery-keyed reconcile repaired drift (a bug, please report): %s", report.drift)
    summary = {
        "reclaim": reclaim,
        "voided": len(report.voided),
        "promoted": len(report.promotions),
        "expired": report.expired,
        "lost": report.lost,
        "drift": report.drift,
        "dropped_keys": report.dropped_keys,
        "pruned": report.pruned,
        "retries_missing": report.retries_missing,
        "settled": settled,
        "settled_after_failover": lost,
        "outbox": outbox,
    }
    logger.info("celery-keyed reconcile: %s", summary)
    return summary


#: Result states that say a task ended for good, and the outcome each is booked as. REVOKED: Celery discarded it as
#: revoked (a revoke reached the worker after its claim had gone back, e.g. a claim taken ahead given back unused).
_FINAL_STATES = {"SUCCESS": "completed", "FAILURE": "failed", "REVOKED": "revoked"}


def settle_from_results(app: Any, ledger: Ledger, *, age: float, limit: int = 100) -> int:
    """D15: an open task with no attempt left in the ledger (no claim, no waiting row) whose result backend
    holds a final result ended its body, but its release never committed (its worker died after the result was
    stored, or after an early ack): book that outcome, so the task does not stay open for ever. Tasks without a
    stored result (``ignore_result``, no backend, or a body that never ended) are left as they are. How many
    were settled."""
    from celery.backends.base import DisabledBackend

    if isinstance(app.backend, DisabledBackend):
        return 0
    settled = 0
    for task_id in ledger.open_idle(age=age, limit=limit):
        try:
            state = app.AsyncResult(task_id).state
        except Exception:
            logger.warning("celery-keyed reconcile: could not read the result of %s", task_id, exc_info=True)
            break
        outcome = _FINAL_STATES.get(state)
        if outcome is None:
            continue
        why = "revoked after its slot went back" if state == "REVOKED" else "its worker was lost before the release"
        done, promotions = ledger.settle(task_id, outcome, detail=f"booked from its {state} result: {why}")
        dispatch(app, promotions)
        if done:
            settled += 1
            logger.warning("celery-keyed reconcile: %s booked %s from its stored result", task_id, outcome)
    return settled

