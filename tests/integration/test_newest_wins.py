"""Newest wins (``on_newer="cancel_running"``, issue 14 item 1) in the ledger, on real Postgres: the cancel request is
recorded with the arrival (atomically, under the key's locks), an attempt that already ended is never cancelled, the
bound holds, one outcome per task id, and the books balance."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict, admit, release
from celery_keyed.ledger.claims import HeldClaim
from tests.integration.test_races import Side, count, wait_until_blocked

HOLDER = "test-host:1:aaaa"


def newest(ledger: Ledger, task_id: str, key: str = "doc:1", *, supersede: str = "report", now=None, **kw) -> Any:
    arrival = Arrival(
        task_id=task_id, key=key, task_name="tasks.render", supersede_key=supersede, on_newer="cancel_running",
        message={"id": task_id}, **kw,
    )
    return ledger.admit(arrival, now=now)


def render(task_id: str, supersede: str = "report") -> Arrival:
    return Arrival(
        task_id=task_id, key="doc:1", task_name="tasks.render", supersede_key=supersede, on_newer="cancel_running",
        message={"id": task_id},
    )


def cancel_of(engine: sa.Engine, task_id: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT cancel_requested_at, cancel_detail FROM keyed_claims WHERE task_id = :t"), {"t": task_id}
        ).first()


def test_a_newer_arrival_asks_the_running_one_to_stop_and_waits_for_its_slot(ledger: Ledger, engine: sa.Engine) -> None:
    a = newest(ledger, "a")
    assert a.verdict is Verdict.ADMITTED and a.cancels == ()
    b = newest(ledger, "b")
    # The request is recorded with the arrival; the newest parks (the mutex is held until a's slot is free).
    assert b.verdict is Verdict.PARKED and b.cancels == (("a", 0, HOLDER),)
    row = cancel_of(engine, "a")
    assert row.cancel_requested_at is not None and row.cancel_detail == "superseded by b (newest wins)"
    assert ledger.cancel_requested([HeldClaim("a", 0, a.fence)]) == {
        HeldClaim("a", 0, a.fence): "superseded by b (newest wins)"
    }
    assert "cancel requested" in ledger.explain("a").text
    assert count(engine, "SELECT sum(used) FROM keyed_slots WHERE key = 'doc:1'") == 1  # never two
    # Its worker ends it and releases it as superseded: the slot goes to the newest, in the same transaction.
    report = ledger.release(Token("a", 0), a.fence, Outcome.SUPERSEDED)
    assert report.released and [p.task_id for p in report.promotions] == ["b"]
    assert report.finished == [("a", "superseded")]
    # One outcome per task id: a late second release (the hooks fire twice) records nothing more.
    assert not ledger.release(Token("a", 0), a.fence, Outcome.FAILED).released
    assert ledger.books() == {"superseded": 1, "open": 1, "arrivals": 2}


def test_an_attempt_that_ended_is_not_cancelled(ledger: Ledger, engine: sa.Engine) -> None:
    a = newest(ledger, "a")
    ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED)  # finished before the newer one arrived
    b = newest(ledger, "b")
    assert b.verdict is Verdict.ADMITTED and b.cancels == ()  # runs normally
    assert ledger.books() == {"completed": 1, "open": 1, "arrivals": 2}


def test_a_release_in_progress_wins_the_race_with_the_cancel(ledger: Ledger, engine: sa.Engine) -> None:
    """The older attempt's release holds its claim row; the newer arrival's cancel UPDATE waits for it (no deadlock:
    the arrival locks the claim row before the slot rows, the order a release takes them in), then finds no row: the
    older attempt keeps its own outcome and the newest is admitted on the slot it freed."""
    a = newest(ledger, "a")
    with engine.connect() as conn, conn.begin():
        assert release.release(conn, Token("a", 0), a.fence, Outcome.COMPLETED).released
        arrival = Side(engine, lambda c: admit.admit(c, render("b"), holder=HOLDER, lease=30.0))
        arrival.start()
        wait_until_blocked(engine, arrival)
    b = arrival.finish()
    assert b.verdict is Verdict.ADMITTED and b.cancels == ()
    assert ledger.books() == {"completed": 1, "open": 1, "arrivals": 2}


def test_the_cancel_commits_with_the_arrival(ledger: Ledger, engine: sa.Engine) -> None:
    """An arrival whose transaction rolls back leaves no cancel request behind."""
    newest(ledger, "a")
    with pytest.raises(RuntimeError), engine.connect() as conn, conn.begin():
        assert admit.admit(conn, render("b"), holder=HOLDER, lease=30.0).cancels == (("a", 0, HOLDER),)
        raise RuntimeError("the arrival's transaction fails after its decision")
    assert cancel_of(engine, "a").cancel_requested_at is None
    assert count(engine, "SELECT count(*) FROM keyed_waiting") == 0


def test_only_the_same_supersede_key_and_only_with_the_policy(ledger: Ledger, engine: sa.Engine) -> None:
    newest(ledger, "a", supersede="report-1")
    other = newest(ledger, "b", supersede="report-2")
    assert other.verdict is Verdict.PARKED and other.cancels == ()  # another document: waits its turn
    plain = ledger.admit(
        Arrival(task_id="c", key="doc:1", task_name="tasks.render", supersede_key="report-1", message={})
    )
    assert plain.verdict is Verdict.PARKED and plain.cancels == ()  # no policy: today's behaviour
    assert cancel_of(engine, "a").cancel_requested_at is None


def test_the_newest_replaces_the_parked_ones_of_its_supersede_key(ledger: Ledger, engine: sa.Engine) -> None:
    a = newest(ledger, "a")
    newest(ledger, "b")
    c = newest(ledger, "c")
    assert c.verdict is Verdict.PARKED and c.superseded == ("b",) and c.cancels == (("a", 0, HOLDER),)
    assert count(engine, "SELECT waiting FROM keyed_keys WHERE key = 'doc:1'") == 1
    report = ledger.release(Token("a", 0), a.fence, Outcome.SUPERSEDED)
    assert [p.task_id for p in report.promotions] == ["c"]
    assert ledger.books() == {"superseded": 2, "open": 1, "arrivals": 3}


def test_the_newest_takes_the_head_of_the_line(ledger: Ledger, engine: sa.Engine) -> None:
    """The slot the cancelled attempt frees goes to the newest, not to the calls queued behind the old one."""
    a = newest(ledger, "a", supersede="report-1")
    newest(ledger, "w", supersede="report-2")  # another document, queued behind a
    b = newest(ledger, "b", supersede="report-1")
    assert b.verdict is Verdict.PARKED and b.cancels == (("a", 0, HOLDER),)
    report = ledger.release(Token("a", 0), a.fence, Outcome.SUPERSEDED)
    assert [p.task_id for p in report.promotions] == ["b"]
    assert count(engine, "SELECT count(*) FROM keyed_waiting WHERE task_id = 'w'") == 1  # next in line


def test_a_promotion_not_bound_yet_is_asked_too(ledger: Ledger, engine: sa.Engine) -> None:
    """The supersede key of a promoted claim is in its stored waiting row."""
    a = ledger.admit(Arrival(task_id="a", key="doc:1", message={}))
    newest(ledger, "b")
    report = ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED)
    assert [p.task_id for p in report.promotions] == ["b"]  # promoted, not bound yet
    c = newest(ledger, "c")
    assert c.verdict is Verdict.PARKED and c.cancels == (("b", 0, None),)
    assert cancel_of(engine, "b").cancel_requested_at is not None


def test_a_retry_of_an_older_task_never_cancels_a_newer_one(ledger: Ledger, engine: sa.Engine, clock) -> None:
    a = newest(ledger, "a", now=clock())
    clock.advance(1)
    ledger.release(Token("a", 0), a.fence, Outcome.RETRY, now=clock())
    b = newest(ledger, "b", now=clock())
    assert b.verdict is Verdict.ADMITTED
    clock.advance(1)
    retry = newest(ledger, "a", attempt=1, now=clock())
    assert retry.verdict is Verdict.PARKED and retry.cancels == ()
    assert cancel_of(engine, "b").cancel_requested_at is None


def test_a_refused_newest_cancels_nothing(ledger: Ledger, engine: sa.Engine) -> None:
    ledger.configure({"doc": NameConfig("doc", limit=1, max_waiting=1)})
    newest(ledger, "a", supersede="report-1")
    newest(ledger, "w", supersede="report-2")  # fills the waiting room
    refused = newest(ledger, "b", supersede="report-1")
    assert refused.verdict is Verdict.REJECTED and refused.cancels == ()
    assert cancel_of(engine, "a").cancel_requested_at is None  # withdrawn in the refused arrival's transaction
    assert ledger.books() == {"rejected": 1, "open": 2, "arrivals": 3}


def test_on_a_gate_the_bound_holds_while_the_older_one_stops(ledger: Ledger, engine: sa.Engine) -> None:
    """K = 2: the newest is admitted on the free slot at once; the older one is asked to stop; never more than K."""
    ledger.configure({"doc": NameConfig("doc", limit=2)})
    a = newest(ledger, "a")
    b = newest(ledger, "b")
    assert b.verdict is Verdict.ADMITTED and b.cancels == (("a", 0, HOLDER),)
    c = newest(ledger, "c")
    assert c.verdict is Verdict.PARKED and {x[0] for x in c.cancels} == {"a", "b"}
    assert count(engine, "SELECT sum(used) FROM keyed_slots WHERE key = 'doc:1'") == 2
    assert [p.task_id for p in ledger.release(Token("a", 0), a.fence, Outcome.SUPERSEDED).promotions] == ["c"]
    assert count(engine, "SELECT sum(used) FROM keyed_slots WHERE key = 'doc:1'") == 2
    assert ledger.books() == {"superseded": 1, "open": 2, "arrivals": 3}


def test_arrival_options_are_checked() -> None:
    with pytest.raises(ValueError, match="on_newer must be None or 'cancel_running'"):
        Arrival(task_id="a", key="doc:1", on_newer="cancel")
    with pytest.raises(ValueError, match="needs a concurrency key"):
        Arrival(task_id="a", group_key="g", on_newer="cancel_running")
    with pytest.raises(ValueError, match="do not combine"):
        Arrival(task_id="a", key="doc:1", task_name="t", on_newer="cancel_running", debounce=1.0)
    # Without a supersede key the newest of the same task wins.
    assert Arrival(task_id="a", key="doc:1", task_name="t", on_newer="cancel_running").supersede_key == "t"
    with pytest.raises(ValueError, match="supersede key or a task name"):
        Arrival(task_id="a", key="doc:1", on_newer="cancel_running")


def test_explain_on_the_command_line(database_url: str, redis_url: str, ledger: Ledger) -> None:
    """``celery keyed explain`` on the old task: cancel requested, then its recorded outcome."""
    from celery import Celery

    from celery_keyed.publisher import close_publisher
    from tests.integration.test_cli import run

    app = Celery("cli-test", broker=redis_url, set_as_current=False)
    app.conf.keyed_database_url = database_url
    try:
        a = newest(ledger, "a")
        newest(ledger, "b")
        assert "cancel requested at" in run(app, "explain", "a").stdout
        ledger.release(Token("a", 0), a.fence, Outcome.SUPERSEDED, detail="superseded by b (newest wins)")
        out = run(app, "explain", "a").stdout
        assert "finished: superseded" in out and "superseded by b" in out
    finally:
        close_publisher(app)
        app.close()
