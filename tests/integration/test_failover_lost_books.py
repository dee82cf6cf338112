"""Books lost with a failover (D20), settled by reconcile from the result backend: on a real primary and streaming
standby (the standby detached, so the primary's last commits are lost with it) and a real Redis result backend, tasks
that arrived, ran and finished on the old primary in the lost window — their workers gone with it — have no row on the
promoted standby; once the failover's hold is over, reconcile books each from its stored result, exactly once."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.app.task import Context

import celery_keyed
from celery_keyed import beat, keyed_task, lost_books
from celery_keyed.exceptions import KeyedRejected
from celery_keyed.ledger import Arrival, Ledger, LostArrival, LostBooks, Outcome, Token, Verdict
from celery_keyed.publisher import close_publisher
from celery_keyed.testbed import PostgresServer
from celery_keyed.testbed_replica import PostgresStandby, crash, multi_host_url
from tests.integration.test_ledger_failover import pair as pair  # the fixture
from tests.integration.test_ledger_failover import pytestmark as pytestmark  # needs pg_basebackup

LEASE = 2.0


@pytest.fixture
def app(pair: tuple[PostgresServer, PostgresStandby], redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    app = Celery("lost-books", broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.keyed_database_url = multi_host_url(list(pair), "postgres")
    app.conf.keyed_lease = LEASE
    app.conf.result_extended = True
    celery_keyed.install(app)
    monkeypatch.setattr(beat, "_last_unreachable", float("-inf"))
    monkeypatch.setattr(lost_books, "_settled", set())
    yield app
    close_publisher(app)


def _store(app: Any, task_id: str, name: str, state: str, *args: Any, error: Exception | None = None) -> None:
    request = Context(id=task_id, task=name, args=list(args), kwargs={}, retries=0, hostname="w@dead")
    result: Any = "done" if state == "SUCCESS" else error or RuntimeError("boom")
    with warnings.catch_warnings():  # redis-py deprecates setex, which Celery's backend still calls
        warnings.simplefilter("ignore", DeprecationWarning)
        app.backend.store_result(task_id, result, state, request=request)


def _books(engine: sa.Engine) -> dict[str, str | None]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.text("SELECT task_id, outcome FROM keyed_tasks")).all())


def _run(ledger: Ledger, task_id: str, account: int, outcome: Outcome | None) -> None:
    admission = ledger.admit(Arrival(task_id=task_id, key=f"acct:{account}", message={"id": task_id}))
    assert admission.verdict is Verdict.ADMITTED and admission.fence is not None
    if outcome is not None:
        assert ledger.release(Token(task_id, 0), admission.fence, outcome).released


def test_tasks_lost_with_the_old_primary_are_booked_once_from_their_results(
    pair: tuple[PostgresServer, PostgresStandby], app: Any
) -> None:
    primary, standby = pair

    @keyed_task(app=app, name="lost.charge", concurrency_key="acct:{account}")
    def charge(account: int) -> None: ...

    @app.task(name="lost.plain")
    def plain(account: int) -> None: ...

    engine = sa.create_engine(multi_host_url([primary, standby], "postgres"), pool_pre_ping=True)
    dead_worker = Ledger(engine, holder="host:1:dead", lease=LEASE)
    try:
        _run(dead_worker, "kept", 1, Outcome.COMPLETED)  # replicated: booked on both
        _store(app, "kept", "lost.charge", "SUCCESS", 1)
        stuck = dead_worker.admit(Arrival(task_id="stuck", key="acct:8", message={"id": "stuck"}))
        assert stuck.fence is not None  # its claim is replicated, its release below is not
        standby.wait_caught_up()
        standby.detach()  # from now on the primary's commits are lost with it
        _run(dead_worker, "ok", 2, Outcome.COMPLETED)
        _store(app, "ok", "lost.charge", "SUCCESS", 2)
        _run(dead_worker, "bad", 3, Outcome.FAILED)
        _store(app, "bad", "lost.charge", "FAILURE", 3)
        _run(dead_worker, "died", 4, None)  # its body never ended: no final result, its message comes back
        _run(dead_worker, "again", 6, Outcome.COMPLETED)  # its result is stored, its message comes back anyway
        _store(app, "again", "lost.charge", "SUCCESS", 6)
        assert dead_worker.release(Token("stuck", 0), stuck.fence, Outcome.COMPLETED).released
        _store(app, "stuck", "lost.charge", "SUCCESS", 8)
        _store(app, "plain", "lost.plain", "SUCCESS", 5)  # an unkeyed task: never in the books
        # refused at its arrival (its waiting room full): booked rejected, its KeyedRejected result stored
        _store(app, "refused", "lost.charge", "FAILURE", 9, error=KeyedRejected("the waiting room of acct:9 is full"))
        assert set(_books(engine)) == {"kept", "ok", "bad", "died", "again", "stuck"}
        crash(primary)
        standby.promote()
        engine.dispose()

        books = LostBooks(engine)
        deadline = time.monotonic() + 60
        while True:  # the first contact with the promoted standby records the failover
            failover = books.last_failover()
            if failover is not None:
                break
            assert time.monotonic() < deadline, "the failover was not recorded"
            time.sleep(0.1)
        assert _books(engine) == {"kept": "completed", "stuck": None}  # what the old primary booked last is gone

        while books.last_failover().holding:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the failover's hold did not end"
            time.sleep(0.1)
        # a redelivered copy of a lost task, running on the new primary: its first run's result does not book it
        # behind its claim (keyed_books_settle's guard); its own release does
        revived = Ledger(engine, holder="host:2:alive", lease=LEASE)
        rerun = revived.admit(Arrival(task_id="again", key="acct:6", message={"id": "again"}))
        assert rerun.verdict is Verdict.ADMITTED and rerun.fence is not None
        summary = beat.reconcile(app)
        assert summary["settled_after_failover"] == 3
        assert _books(engine) == {
            "kept": "completed", "ok": "completed", "bad": "failed", "refused": "rejected", "again": None, "stuck": None
        }
        assert revived.release(Token("again", 0), rerun.fence, Outcome.COMPLETED).released
        with engine.connect() as conn:
            detail = conn.scalar(sa.text("SELECT detail FROM keyed_tasks WHERE task_id = 'ok'"))
        assert "failover" in detail

        # settled once: again, from another reconciler, and straight through the guarded statement
        assert beat.reconcile(app)["settled_after_failover"] == 0
        lost_books._settled.clear()
        assert beat.reconcile(app)["settled_after_failover"] == 0
        assert not books.settle(LostArrival("ok", 0, "lost.charge", "acct:2", "failed"))
        assert _books(engine) == {
            "kept": "completed", "ok": "completed", "bad": "failed", "refused": "rejected", "again": "completed",
            "stuck": None,
        }

        # the task whose body never ended comes back with its message: admitted and booked by its run
        _run(revived, "died", 4, Outcome.COMPLETED)
        assert _books(engine)["died"] == "completed"

        # the task whose books stayed open with the dead worker's claim: reclaimed once the reaper may (a lease after
        # the hold), then booked from its result
        while _books(engine)["stuck"] is None:
            assert time.monotonic() < deadline + 60, "the stuck claim's task was not settled"
            beat.reconcile(app)
            time.sleep(0.2)
        assert _books(engine) == {
            "kept": "completed", "ok": "completed", "bad": "failed", "refused": "rejected", "again": "completed",
            "died": "completed", "stuck": "completed",
        }
    finally:
        engine.dispose()

