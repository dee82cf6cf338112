"""The reconciler beat task on real Postgres and Redis: a dead worker's slot is reclaimed and the parked
attempt behind it is republished with its admission token."""

from __future__ import annotations

import json
import time

import redis
import sqlalchemy as sa
from celery import Celery

import celery_keyed
from celery_keyed import beat
from celery_keyed.ledger import Arrival, Ledger, Verdict
from celery_keyed.publisher import close_publisher
from celery_keyed.task import HEADER_NONCE


def test_reconcile_task_reclaims_and_republishes(database_url: str, redis_url: str, monkeypatch) -> None:
    app = Celery("beat-test", broker=redis_url, set_as_current=False)
    app.conf.keyed_database_url = database_url
    app.conf.keyed_lease = 1.0
    celery_keyed.install(app)
    assert "celery_keyed.reconcile" in app.tasks
    assert any(e["task"] == "celery_keyed.reconcile" for e in app.conf.beat_schedule.values())
    monkeypatch.setattr(beat, "_last_unreachable", float("-inf"))  # this process reached the ledger for long

    engine = sa.create_engine(database_url)
    dead_worker = Ledger(engine, lease=1.0)
    message = {
        "task": "proj.t", "body": "W1tdLCB7fSwge31d", "content_type": "application/json",
        "content_encoding": "utf-8", "headers": {"id": "b", "task": "proj.t"}, "properties": {},
        "exchange": "", "routing_key": "celery",
    }  # fmt: skip
    assert dead_worker.admit(Arrival("a", key="k:1", message=message)).verdict is Verdict.ADMITTED
    assert dead_worker.admit(Arrival("b", key="k:1", message=message)).verdict is Verdict.PARKED
    time.sleep(1.2)  # the dead worker's lease lapses (nothing renews it)

    summary = beat.reconcile(app)
    assert summary["reclaim"] == "1 reclaimed" and summary["promoted"] == 1
    raw = redis.Redis.from_url(redis_url).lpop("celery")
    assert raw is not None
    published = json.loads(raw)
    assert published["headers"]["id"] == "b" and published["headers"][HEADER_NONCE]
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT state FROM keyed_claims WHERE task_id = 'b'")).scalar() == "promoted"
    engine.dispose()
    close_publisher(app)


def test_reconcile_skips_reclaim_until_reachable_for_a_lease(database_url: str, monkeypatch) -> None:
    app = Celery("beat-test", broker="memory://", set_as_current=False)
    app.conf.keyed_database_url = database_url
    app.conf.keyed_lease = 60.0
    celery_keyed.install(app)
    monkeypatch.setattr(beat, "_last_unreachable", time.monotonic())
    assert beat.reconcile(app)["reclaim"].startswith("skipped")
    close_publisher(app)
