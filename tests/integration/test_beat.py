"""The reconciler beat task on real Postgres and Redis: a dead worker's slot is reclaimed and the parked
attempt behind it is republished with its admission token."""

from __future__ import annotations

import json
import time
import warnings

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


def test_reconcile_books_a_finished_task_whose_release_never_committed(
    database_url: str, redis_url: str, monkeypatch
) -> None:
    """D15: a worker stored the task's SUCCESS, then died before the release committed (or after an early ack):
    the reaper booked "worker lost" and no redelivery will come. Reconcile reads the stored result and books the
    outcome; a task between attempts (no final result) and a running one stay open."""
    app = Celery("beat-test", broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.keyed_database_url = database_url
    app.conf.keyed_lease = 1.0
    celery_keyed.install(app)
    monkeypatch.setattr(beat, "_last_unreachable", float("-inf"))
    engine = sa.create_engine(database_url)
    dead_worker = Ledger(engine, lease=1.0)
    for task_id in ("done", "between", "running"):
        assert dead_worker.admit(Arrival(task_id, key=f"k:{task_id}", message={})).verdict is Verdict.ADMITTED
    time.sleep(1.2)
    alive = Ledger(engine, lease=60.0)
    with engine.begin() as conn:  # the reaper took the two dead claims as "worker lost"; "running" is renewed
        conn.execute(
            sa.text("UPDATE keyed_claims SET lease_expires_at = now() + interval '1 hour' WHERE task_id = 'running'")
        )
    with warnings.catch_warnings():  # redis-py deprecates setex, which Celery's backend still calls
        warnings.simplefilter("ignore", DeprecationWarning)
        app.backend.mark_as_done("done", 42)
        app.backend.mark_as_retry("between", RuntimeError("again"))
        app.backend.mark_as_done("running", 1)  # stored, its release not run yet: the claim is still there

    summary = beat.reconcile(app)
    assert summary["settled"] == 1
    with engine.connect() as conn:
        outcomes = dict(conn.execute(sa.text("SELECT task_id, outcome FROM keyed_tasks")).all())
    assert outcomes == {"done": "completed", "between": None, "running": None}
    assert beat.reconcile(app)["settled"] == 0
    assert alive.books()["completed"] == 1
    engine.dispose()
    close_publisher(app)
