"""The sweep at scale (bench.scale's 1,000,000-row ledger, docs/benchmarks.md): every worker sweeps every
``keyed_sweep_interval``, so its backstop promotion (D2) must touch only the keys where a waiter can start, and its
reads of rare rows must not go through every parked row."""

from __future__ import annotations

import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger
from celery_keyed.ledger import waiting as waiting_sql


def promotable_keys(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return sorted(conn.execute(waiting_sql.WAITING_KEYS_PROMOTABLE, {"limit": 100, "now": None}).scalars())


def test_only_keys_with_waiters_and_room_are_swept(ledger: Ledger, engine: sa.Engine) -> None:
    for key in ("full:1", "full:2", "room:1", "paused:1"):
        ledger.admit(Arrival(f"{key}-a", key=key))  # runs
        ledger.admit(Arrival(f"{key}-b", key=key))  # parks behind it
    ledger.admit(Arrival("alone:1-a", key="alone:1"))  # runs, nobody waits
    assert promotable_keys(engine) == []  # every key with a line is full: no promotion to try
    with engine.begin() as conn:  # room without its promotion (a lost wakeup, as the sweep's backstop must catch)
        for key in ("room:1", "paused:1"):
            conn.execute(sa.text("DELETE FROM keyed_claims WHERE key = :k"), {"k": key})
            conn.execute(sa.text("UPDATE keyed_slots SET used = 0 WHERE key = :k"), {"k": key})
    ledger.pause_key("paused:1", 3600.0, reason="vendor said 429")  # a paused key has no room
    assert promotable_keys(engine) == ["room:1"]
    assert [p.task_id for p in ledger.sweep().promotions] == ["room:1-b"]
    assert promotable_keys(engine) == []

