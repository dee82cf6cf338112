"""The books' retention (issue 9 item 12) on real Postgres: reconcile prunes finished task ids older than
``keyed_books_retention`` in bounded batches, never an open task (waiting, running, between attempts), never an
outcome whose failure result is not stored yet, never a task that still holds a slot; and the books still balance
(pruned task ids are counted by outcome, so they never show up as a change in the books or as drift)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from celery import Celery

import celery_keyed
from celery_keyed import beat
from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict
from celery_keyed.ledger.books import books_mark_notified
from celery_keyed.ledger.reconcile import prune_books_once
from celery_keyed.publisher import close_publisher
from celery_keyed.settings import read_settings

DAY = 86400.0


@pytest.fixture
def long_lease(engine: sa.Engine) -> Ledger:
    """A ledger whose leases outlast the test's clock jumps: reconcile then reclaims nothing (the server has not
    been up for a whole lease, D7), so only the retention changes the books."""
    return Ledger(engine, holder="test-host:1:bbbb", lease=10 * DAY, dispatch=10.0)


def _admit(ledger: Ledger, task_id: str, key: str, now: datetime, attempt: int = 0) -> int | None:
    admission = ledger.admit(Arrival(task_id, attempt=attempt, key=key, message={"id": task_id}), now=now)
    return admission.fence


def _done(ledger: Ledger, task_id: str, key: str, now: datetime, outcome: Outcome = Outcome.COMPLETED) -> None:
    fence = _admit(ledger, task_id, key, now)
    assert fence is not None
    assert ledger.release(Token(task_id, 0), fence, outcome, now=now).released


def _task_ids(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(sa.text("SELECT task_id FROM keyed_tasks")).scalars())


@pytest.fixture
def books(long_lease: Ledger, engine: sa.Engine, clock) -> dict[str, set[str]]:
    """Every kind of row the books hold, finished at t0 (old) unless said otherwise."""
    ledger, t0 = long_lease, clock()
    ledger.configure({"full": NameConfig("full", limit=1, max_waiting=0)}, now=t0)
    for i in range(5):
        _done(ledger, f"done{i}", f"done:{i}", t0)
    _done(ledger, "failed", "failed:1", t0, Outcome.FAILED)
    assert ledger.admit(Arrival("holder", key="full:1", message={"id": "holder"}), now=t0).admitted  # runs
    for task_id in ("rejected", "rejected-unstored"):
        verdict = ledger.admit(Arrival(task_id, key="full:1", message={"id": task_id}), now=t0).verdict
        assert verdict is Verdict.REJECTED
    with engine.begin() as conn:  # the gate stored the KeyedRejected result of one of them
        books_mark_notified(conn, ["rejected"])
    assert _admit(ledger, "runner", "line:1", t0) is not None
    assert ledger.admit(Arrival("waiter", key="line:1", message={"id": "waiter"}), now=t0).verdict is Verdict.PARKED
    fence = _admit(ledger, "between", "retry:1", t0)
    assert fence is not None
    ledger.release(Token("between", 0), fence, Outcome.RETRY, now=t0)  # its retry is in its countdown
    fence = _admit(ledger, "uncertain", "hold:1", t0)
    assert fence is not None  # ended by a hard time limit: outcome booked, slot held for 30 days
    ledger.release(Token("uncertain", 0), fence, Outcome.FAILED, uncertain=True, hold=30 * DAY, now=t0)
    _done(ledger, "recent", "done:9", t0 + timedelta(days=2))
    return {
        "pruned": {"done0", "done1", "done2", "done3", "done4", "failed", "rejected"},
        "kept": {"holder", "rejected-unstored", "runner", "waiter", "between", "uncertain", "recent"},
    }


def test_reconcile_prunes_old_finished_task_ids_and_the_books_still_balance(
    long_lease: Ledger, engine: sa.Engine, clock, books: dict[str, set[str]]
) -> None:
    before = long_lease.books()
    assert before == {"completed": 6, "failed": 2, "rejected": 2, "open": 4, "arrivals": 14}
    assert _task_ids(engine) == books["pruned"] | books["kept"]

    within = long_lease.reconcile(now=clock.advance(DAY - 60), books_retention=DAY)
    assert within.pruned == 0 and _task_ids(engine) == books["pruned"] | books["kept"]

    report = long_lease.reconcile(now=clock.advance(120), books_retention=DAY)
    assert report.pruned == len(books["pruned"]) and report.drift == []
    assert _task_ids(engine) == books["kept"]  # open, unstored, still holding a slot, or finished within a day
    assert long_lease.books() == before  # the pruned ids are still counted, by outcome
    with engine.connect() as conn:
        pruned = dict(conn.execute(sa.text("SELECT outcome, tasks FROM keyed_books_pruned")).all())
    assert pruned == {"completed": 5, "failed": 1, "rejected": 1}

    # the next run only prunes what became old since; still balanced, still no drift
    later = long_lease.reconcile(now=clock.advance(2 * DAY), books_retention=DAY)
    assert later.pruned == 1 and later.drift == [] and "recent" not in _task_ids(engine)
    assert long_lease.books() == before


def test_without_a_retention_reconcile_keeps_every_row(
    long_lease: Ledger, engine: sa.Engine, clock, books: dict[str, set[str]]
) -> None:
    assert long_lease.reconcile(now=clock.advance(365 * DAY)).pruned == 0
    assert _task_ids(engine) == books["pruned"] | books["kept"]


def test_pruning_goes_in_bounded_batches(long_lease: Ledger, engine: sa.Engine, clock, books) -> None:
    now = clock.advance(DAY + 60)
    assert prune_books_once(engine, retention=DAY, now=now, batch=2, batches=2) == 4  # at most 2 x 2 per run
    assert prune_books_once(engine, retention=DAY, now=now, batch=2, batches=2) == 3
    assert prune_books_once(engine, retention=DAY, now=now, batch=2, batches=2) == 0
    assert _task_ids(engine) == books["kept"]
    assert long_lease.books()["arrivals"] == 14


def test_a_copy_delivered_after_the_retention_is_a_new_arrival(long_lease: Ledger, engine: sa.Engine, clock) -> None:
    """Documented: a pruned task id is forgotten, so the retention must outlast any redelivery."""
    t0 = clock()
    _done(long_lease, "a", "acct:1", t0)
    assert long_lease.admit(Arrival("a", key="acct:1"), now=clock.advance(60)).verdict is Verdict.DUPLICATE
    assert long_lease.prune_books(DAY, now=clock.advance(DAY)) == 1
    assert "longer ago than keyed_books_retention" in long_lease.explain("a", now=clock()).text
    assert long_lease.admit(Arrival("a", key="acct:1"), now=clock()).verdict is Verdict.ADMITTED


@pytest.fixture
def app(database_url: str) -> Iterator[Celery]:
    app = Celery("retention", broker="memory://", set_as_current=False)
    app.conf.keyed_database_url = database_url
    celery_keyed.install(app)
    yield app
    close_publisher(app)
    app.close()


@pytest.mark.parametrize("reachable_for_a_lease", [True, False])
def test_the_beat_task_prunes_after_keyed_books_retention(
    app: Celery, engine: sa.Engine, monkeypatch, reachable_for_a_lease: bool
) -> None:
    app.conf.keyed_books_retention = 3600
    monkeypatch.setattr(beat, "_last_unreachable", float("-inf") if reachable_for_a_lease else 1e18)
    ledger = Ledger(engine, lease=60.0)
    _done(ledger, "old", "acct:1", datetime.now(UTC) - timedelta(hours=2))
    _done(ledger, "new", "acct:2", datetime.now(UTC) - timedelta(minutes=30))
    assert beat.reconcile(app)["pruned"] == 1
    assert _task_ids(engine) == {"new"}
    assert ledger.books() == {"completed": 2, "arrivals": 2}


def test_the_retention_setting() -> None:
    url = "postgresql://u@h/db"
    assert read_settings({"keyed_database_url": url}).books_retention == 7 * DAY
    assert read_settings({"keyed_database_url": url, "keyed_books_retention": 0}).books_retention is None
    assert read_settings({"keyed_database_url": url, "keyed_books_retention": 60}).books_retention == 60.0
    for bad in (-1, float("inf"), 1e300, "7d", True):
        with pytest.raises(ValueError, match="keyed_books_retention must be a positive number of seconds"):
            read_settings({"keyed_database_url": url, "keyed_books_retention": bad})


def test_reconcile_prunes_the_ledgers_events_after_the_retention_but_a_failovers(engine: sa.Engine) -> None:
    """``keyed_events`` (drift repaired, forced releases, reclaimed leases, duplicates) would otherwise grow for ever:
    reconcile forgets the events older than ``keyed_books_retention`` with the books, in batches; a failover's event
    stays (the reconciler settles the books of the tasks lost with it from it)."""
    now = datetime.now(UTC)
    with engine.begin() as conn:
        for n, (kind, age) in enumerate(
            [("duplicate", 2 * DAY), ("drift", 2 * DAY), ("reclaimed", 2 * DAY), ("failover", 2 * DAY),
             ("duplicate", DAY - 60), ("drift", 60)]
        ):
            conn.execute(sa.text("INSERT INTO keyed_events (kind, key, detail, at) VALUES (:k, :key, '', :at)"),
                         {"k": kind, "key": f"acct:{n}", "at": now - timedelta(seconds=age)})
    prune_books_once(engine, retention=DAY, now=now, batch=2)  # two per transaction: three transactions
    with engine.connect() as conn:
        left = sorted(conn.execute(sa.text("SELECT kind, key FROM keyed_events")).all())
    assert left == [("drift", "acct:5"), ("duplicate", "acct:4"), ("failover", "acct:3")]
