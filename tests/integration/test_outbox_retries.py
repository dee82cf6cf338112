"""A retry is a publish like any other, on real Postgres: a keyed retry is registered by the attempt it starts (with
a copy when the outbox is on for the task, else without one); the arrival of that attempt — not the task's first
arrival — clears it; a retry that never arrives is published again by the relay from its copy and the copy is
admitted (a late original is then a duplicate, D8); reconcile reports a task stuck between attempts, outbox or not,
once per retry, and drops the registrations of retries that are over."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_keyed import keyed_task
from celery_keyed.ledger import Arrival, Ledger, Outcome, Token, Verdict
from celery_keyed.publisher import close_publisher, relay_outbox

MESSAGE = {"task": "t", "body": "", "content_type": "application/json", "content_encoding": "utf-8",
           "headers": {"id": "a", "retries": 1}, "properties": {}, "exchange": "", "routing_key": "celery"}


def _row(scalar, task_id: str = "a") -> object:
    return scalar("SELECT attempt FROM keyed_outbox WHERE task_id = :t", t=task_id)


def _between_attempts(ledger: Ledger, clock, task_id: str = "a", key: str = "feed:1") -> None:
    """Attempt 0 of ``task_id`` ran and asked for a retry: the task is open, with no claim and no waiting row."""
    first = ledger.admit(Arrival(task_id, key=key), now=clock())
    assert first.verdict is Verdict.ADMITTED
    ledger.release(Token(task_id, 0), first.fence or 0, Outcome.RETRY, now=clock())
    assert ledger.explain(task_id, now=clock()).state == "between_attempts"


def test_a_retry_is_registered_by_its_attempt_and_only_that_attempt_clears_it(ledger: Ledger, clock, scalar) -> None:
    _between_attempts(ledger, clock)
    assert ledger.register_retry("a", 1, MESSAGE, key="feed:1", arrival_timeout=60, now=clock())
    assert _row(scalar) == 1
    assert not ledger.register_retry("a", 1, {**MESSAGE, "body": "x"}, key="feed:1", now=clock())  # kept: first copy
    # a late duplicate of attempt 0 is not the retry: the row stays
    assert ledger.admit(Arrival("a", attempt=0, key="feed:1"), now=clock()).verdict is Verdict.DUPLICATE
    assert _row(scalar) == 1
    assert ledger.outbox_due(arrival_timeout=60, now=clock()) == []  # not due before its timeout
    second = ledger.admit(Arrival("a", attempt=1, key="feed:1"), now=clock())
    assert second.verdict is Verdict.ADMITTED
    assert _row(scalar) is None  # gone in the statement that took attempt 1's claim
    assert not ledger.register_retry("a", 1, MESSAGE, key="feed:1", now=clock())  # arrived: not registered again
    assert ledger.outbox_due(arrival_timeout=60, now=clock.advance(3600)) == []


def test_a_parked_retry_clears_it_too(ledger: Ledger, clock, scalar) -> None:
    _between_attempts(ledger, clock)
    ledger.admit(Arrival("holder", key="feed:1"), now=clock())  # the key's one slot is taken
    ledger.register_retry("a", 1, None, key="feed:1", arrival_timeout=60, now=clock())
    assert ledger.admit(Arrival("a", attempt=1, key="feed:1"), now=clock()).verdict is Verdict.PARKED
    assert _row(scalar) is None


def test_a_retry_of_a_task_not_open_is_not_registered(ledger: Ledger, clock, scalar) -> None:
    assert not ledger.register_retry("never-arrived", 1, MESSAGE, key="feed:1", now=clock())
    done = ledger.admit(Arrival("done", key="feed:1"), now=clock())
    ledger.release(Token("done", 0), done.fence or 0, Outcome.COMPLETED, now=clock())
    assert not ledger.register_retry("done", 1, MESSAGE, key="feed:1", now=clock())
    with pytest.raises(ValueError):
        ledger.register_retry("done", 0, MESSAGE)
    assert scalar("SELECT count(*) FROM keyed_outbox") == 0


def test_a_retry_never_received_is_republished_and_its_copy_admitted(ledger: Ledger, clock, scalar) -> None:
    _between_attempts(ledger, clock)
    ledger.register_retry("a", 1, MESSAGE, key="feed:1", arrival_timeout=60, now=clock())
    assert "retry 1 published at" in ledger.explain("a", now=clock()).text
    assert [(o.name, o.not_received) for o in ledger.outbox()] == [("feed", 1)]
    (due,) = ledger.outbox_due(arrival_timeout=60, now=clock.advance(61))
    assert (due.task_id, due.republish, due.republished, due.message) == ("a", True, 1, MESSAGE)
    assert ledger.outbox_due(arrival_timeout=60, now=clock.advance(61)) == []  # next one at +120 s
    # the copy arrives and runs; the original, if it was only late, is a duplicate
    copy = ledger.admit(Arrival("a", attempt=1, key="feed:1"), now=clock())
    assert copy.verdict is Verdict.ADMITTED
    assert _row(scalar) is None
    ledger.release(Token("a", 1), copy.fence or 0, Outcome.COMPLETED, now=clock())
    assert ledger.admit(Arrival("a", attempt=1, key="feed:1"), now=clock()).verdict is Verdict.DUPLICATE
    assert ledger.books() == {"completed": 1, "arrivals": 1}


def test_reconcile_reports_a_task_stuck_between_attempts(ledger: Ledger, clock, scalar) -> None:
    """Without the outbox (no copy): the relay has nothing to publish; reconcile reports the task once it is overdue,
    one event per retry however many runs see it, and stops counting it when its attempt arrives."""
    _between_attempts(ledger, clock)
    ledger.register_retry("a", 1, None, task_name="t", key="feed:1", arrival_timeout=60, now=clock())
    assert ledger.reconcile(now=clock.advance(30)).retries_missing == 0
    assert ledger.outbox_due(arrival_timeout=60, now=clock.advance(31)) == []  # no copy: never taken
    assert ledger.reconcile(now=clock()).retries_missing == 1
    told = ledger.explain("a", now=clock())
    assert told.state == "between_attempts" and told.text.endswith(
        "not received in time, no copy to publish again (reported by reconcile)"
    )
    assert ledger.reconcile(now=clock.advance(10)).retries_missing == 1
    assert ledger.outbox() == []  # a retry without a copy is not the outbox's (status)
    events = scalar("SELECT array_agg(task_id || ' ' || detail) FROM keyed_events WHERE kind = 'retry_missing'")
    assert events == ["a attempt 1 of t not received in time: no copy to publish again (the outbox is off for this"
                      " task)"]
    ledger.admit(Arrival("a", attempt=1, key="feed:1"), now=clock())
    assert ledger.reconcile(now=clock.advance(3600)).retries_missing == 0


def test_reconcile_reports_a_republished_retry_and_drops_one_that_is_over(ledger: Ledger, clock, scalar) -> None:
    _between_attempts(ledger, clock)
    ledger.register_retry("a", 1, MESSAGE, key="feed:1", arrival_timeout=60, now=clock())
    ledger.outbox_due(arrival_timeout=60, now=clock.advance(61))  # the relay published it again
    assert ledger.reconcile(now=clock()).retries_missing == 1
    assert "published again 1 times so far" in str(
        scalar("SELECT detail FROM keyed_events WHERE kind = 'retry_missing'")
    )
    ledger.revoke("a", now=clock())  # revoked between attempts: nothing is left to deliver
    assert ledger.reconcile(now=clock.advance(10)).retries_missing == 0
    assert _row(scalar) is None
    assert ledger.outbox_due(arrival_timeout=60, now=clock.advance(3600)) == []


# -- through apply_async (memory broker) ----------------------------------------------------------------------


@pytest.fixture
def app(database_url: str) -> Iterator[Celery]:
    app = Celery("outbox-retries", broker="memory://", set_as_current=False)
    app.conf.keyed_database_url = database_url
    app.conf.keyed_send_arrival_timeout = 60
    with app.connection_for_write() as broker:  # the memory transport's queues outlive an app: start empty
        broker.default_channel.queue_declare("celery")
        broker.default_channel.queue_purge("celery")
    yield app
    close_publisher(app)
    app.close()


def _pop(app: Celery):
    with app.connection_for_write() as broker:
        return broker.default_channel.basic_get("celery", no_ack=True)


@pytest.mark.parametrize("outbox", [True, False])
def test_a_keyed_retry_is_registered_at_its_publish(
    app: Celery, ledger: Ledger, clock, scalar, engine: sa.Engine, outbox: bool
) -> None:
    """``retries=1`` (what ``Task.retry`` publishes): registered by attempt 1, with its copy when the outbox is on
    for the task; lost by the broker, the relay publishes the copy again, as the same retry."""

    @keyed_task(app=app, name="outbox.r", concurrency_key="{key}", register_at_publish=outbox)
    def r(key: str) -> None: ...

    _between_attempts(ledger, clock, "a")
    r.apply_async(("feed:1",), task_id="a", retries=1, countdown=5)
    assert _row(scalar) == 1
    assert scalar("SELECT message IS NOT NULL FROM keyed_outbox WHERE task_id = 'a'") is outbox
    due_in = scalar("SELECT extract(epoch FROM due_at - registered_at) FROM keyed_outbox WHERE task_id = 'a'")
    assert float(due_in) >= 64  # type: ignore[arg-type]  # the countdown, then the arrival timeout
    lost = _pop(app)  # the broker loses it
    assert lost is not None and lost.headers["retries"] == 1
    counts = relay_outbox(app, ledger, arrival_timeout=60, now=clock.advance(3600))
    again = _pop(app)
    if outbox:
        assert counts["republished"] == 1
        assert (again.headers["id"], again.headers["retries"]) == ("a", 1)
        assert json.loads(again.body)[0] == ["feed:1"]
    else:
        assert counts["republished"] == 0 and again is None
        assert ledger.reconcile(now=clock()).retries_missing == 1
