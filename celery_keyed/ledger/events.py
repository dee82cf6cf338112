"""Ledger facts for operators (table ``keyed_events``): drift repaired by reconcile, forced releases
(a recorded breach of the bound, DESIGN §3.1), reclaimed leases."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa

from celery_keyed.ledger.clock import NOW

EVENTS_RECORD = sa.text(
    f"INSERT INTO keyed_events (kind, key, task_id, detail, at) VALUES (:kind, :key, :task_id, :detail, {NOW})"
)


def events_record(
    conn: sa.Connection,
    kind: str,
    *,
    key: str | None = None,
    task_id: str | None = None,
    detail: str = "",
    now: datetime | None = None,
) -> None:
    conn.execute(EVENTS_RECORD, {"kind": kind, "key": key, "task_id": task_id, "detail": detail, "now": now})


# events_prune: forget up to :batch events older than :retention seconds, oldest first (through keyed_events_at_idx),
# as reconcile prunes the books; a failover's event is kept (the reconciler reads it when it settles the books of
# the tasks lost with it, and there are few).
EVENTS_PRUNE = sa.text(
    f"""
    WITH gone AS (
        DELETE FROM keyed_events e USING (
            SELECT id FROM keyed_events
             WHERE at < {NOW} - make_interval(secs => :retention) AND kind <> 'failover'
             ORDER BY at LIMIT :batch) v
         WHERE e.id = v.id
        RETURNING 1
    )
    SELECT count(*) FROM gone
    """
)


def events_prune(conn: sa.Connection, *, retention: float, batch: int, now: datetime | None = None) -> int:
    """Prune one batch of events older than ``retention`` seconds; returns how many."""
    return int(conn.execute(EVENTS_PRUNE, {"retention": retention, "batch": batch, "now": now}).scalar_one())
