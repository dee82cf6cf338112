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
