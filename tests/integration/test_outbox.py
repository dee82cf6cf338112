"""The outbox (issue 14 item 8) on real Postgres: a message registered at publish stays in ``keyed_outbox`` until
its task's arrival is recorded (the trigger deletes it in the statement that inserts the task's books row); the
relay takes what no worker received within the arrival timeout, once per period; a registration in the caller's
transaction rolls back with it and is published by the relay only after its commit; a second copy of a received
task is a duplicate (D8); the books balance."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_keyed import keyed_task
from celery_keyed.ledger import Arrival, Ledger, Outcome, Token, Verdict, outbox_register
from celery_keyed.messages import record_message
from celery_keyed.publisher import close_publisher, relay_outbox

MESSAGE = {"task": "t", "body": "", "content_type": "application/json", "content_encoding": "utf-8",
           "headers": {"id": "a"}, "properties": {}, "exchange": "", "routing_key": "celery"}


def _rows(scalar) -> int:
    return int(scalar("SELECT count(*) FROM keyed_outbox"))


def test_arrival_deletes_the_registration_in_its_statement(ledger: Ledger, clock, scalar) -> None:
    assert ledger.register_at_publish("a", MESSAGE, key="feed:1", arrival_timeout=60, now=clock())
    assert _rows(scalar) == 1
    assert ledger.outbox_due(arrival_timeout=60, now=clock()) == []  # not due before its timeout
    assert ledger.admit(Arrival("a", key="feed:1"), now=clock()).verdict is Verdict.ADMITTED
    assert _rows(scalar) == 0  # received: gone with the statement that booked the arrival
    assert ledger.outbox_due(arrival_timeout=60, now=clock.advance(3600)) == []


@pytest.mark.parametrize("path", ["fast", "parked", "grouped", "batch"])
def test_every_arrival_path_consumes_it(ledger: Ledger, clock, scalar, path: str) -> None:
    """The fast claim, a park (keyed_admit_plain), the general transaction (a group) and the batch claim
    (keyed_claim_many) all insert the books row; the trigger covers each."""
    if path == "parked":
        ledger.admit(Arrival("holder", key="feed:1"), now=clock())
    if path == "batch":
        ledger.admit(Arrival("warm", key="feed:1"), now=clock())  # a key seen before: the batch call claims
        ledger.release(Token("warm", 0), 1, Outcome.COMPLETED, now=clock())
    ledger.register_at_publish("a", MESSAGE, key="feed:1", arrival_timeout=60, now=clock())
    arrival = Arrival("a", key="feed:1", group_key="order:1" if path == "grouped" else None)
    if path == "batch":
        (admission,) = ledger.admit_many([arrival], now=clock())
    else:
        admission = ledger.admit(arrival, now=clock())
    assert admission.verdict is (Verdict.PARKED if path == "parked" else Verdict.ADMITTED)
    assert _rows(scalar) == 0


def test_not_received_is_republished_once_per_period(ledger: Ledger, clock, scalar) -> None:
    """Lost by the broker: due after the arrival timeout, taken by one relay call, then due again only after the
    doubled period; explain says so."""
    ledger.register_at_publish("lost", MESSAGE, key="feed:1", arrival_timeout=60, now=clock())
    assert ledger.explain("lost", now=clock()).text.endswith("republished 0 times; published again at "
                                                             f"{clock() + timedelta(seconds=60)} if still not received")
    (due,) = ledger.outbox_due(arrival_timeout=60, now=clock.advance(61))
    assert (due.task_id, due.republish, due.republished, due.message) == ("lost", True, 1, MESSAGE)
    assert ledger.outbox_due(arrival_timeout=60, now=clock.advance(61)) == []  # next one at +120 s
    told = ledger.explain("lost", now=clock())
    assert told.state == "outbox" and "not received by a worker yet, republished 1 time;" in told.text
    (again,) = ledger.outbox_due(arrival_timeout=60, now=clock.advance(60))
    assert again.republished == 2
    assert [(o.name, o.not_received, o.republished_tasks, o.republished) for o in ledger.outbox()] == [
        ("feed", 1, 1, 2)
    ]
    # the republished copy arrives: the row goes, nothing more is republished
    ledger.admit(Arrival("lost", key="feed:1"), now=clock())
    assert _rows(scalar) == 0 and ledger.outbox() == []


def test_a_late_first_copy_is_a_duplicate_and_the_books_balance(ledger: Ledger, clock) -> None:
    """Republished because the first copy was late, not lost: both arrive; the second is dropped (D8)."""
    ledger.register_at_publish("late", MESSAGE, key="feed:1", arrival_timeout=60, now=clock())
    assert len(ledger.outbox_due(arrival_timeout=60, now=clock.advance(61))) == 1
    first = ledger.admit(Arrival("late", key="feed:1"), now=clock())
    assert first.verdict is Verdict.ADMITTED
    ledger.release(Token("late", 0), first.fence or 0, Outcome.COMPLETED, now=clock())
    assert ledger.admit(Arrival("late", key="feed:1"), now=clock()).verdict is Verdict.DUPLICATE
    assert ledger.books() == {"completed": 1, "arrivals": 1}
    assert ledger.outbox_due(arrival_timeout=60, now=clock.advance(3600)) == []


def test_arrived_or_registered_task_ids_are_not_registered_again(ledger: Ledger, clock, scalar) -> None:
    ledger.admit(Arrival("known", key="feed:1"), now=clock())
    assert not ledger.register_at_publish("known", MESSAGE, key="feed:1", now=clock())  # a retry, a re-send
    assert ledger.register_at_publish("new", MESSAGE, key="feed:1", now=clock())
    assert not ledger.register_at_publish("new", {**MESSAGE, "body": "x"}, key="feed:1", now=clock())
    assert scalar("SELECT message->>'body' FROM keyed_outbox WHERE task_id = 'new'") == ""


def test_revoked_before_arrival_is_not_republished(ledger: Ledger, clock, scalar) -> None:
    ledger.register_at_publish("r", MESSAGE, key="feed:1", arrival_timeout=60, now=clock())
    ledger.revoke("r", now=clock())
    assert _rows(scalar) == 0
    assert ledger.outbox_due(arrival_timeout=60, now=clock.advance(61)) == []


def test_registration_in_the_callers_transaction(engine: sa.Engine, ledger: Ledger, clock, scalar) -> None:
    """Pending: published by the relay after the commit (a first publish, not a republish); rolled back with it."""
    with engine.connect() as conn:
        tx = conn.begin()
        assert outbox_register(conn, "gone", MESSAGE, key="feed:1", pending=True, now=clock())
        tx.rollback()
    assert _rows(scalar) == 0
    with engine.begin() as conn:
        outbox_register(conn, "kept", MESSAGE, key="feed:1", pending=True, now=clock())
    assert "not published yet" in ledger.explain("kept", now=clock()).text
    (due,) = ledger.outbox_due(arrival_timeout=60, now=clock())
    assert (due.task_id, due.republish, due.republished) == ("kept", False, 0)
    assert ledger.outbox_due(arrival_timeout=60, now=clock.advance(30)) == []
    assert ledger.outbox_due(arrival_timeout=60, now=clock.advance(31))[0].republish


def test_two_relays_never_take_one_row_at_once(engine: sa.Engine, ledger: Ledger, clock) -> None:
    """SKIP LOCKED: a relay holding a due row leaves it to nobody else until its period is over."""
    ledger.register_at_publish("x", MESSAGE, key="feed:1", arrival_timeout=60, now=clock())
    later = clock.advance(61)
    with engine.connect() as conn:
        tx = conn.begin()
        conn.execute(sa.text("SELECT 1 FROM keyed_outbox WHERE task_id = 'x' FOR UPDATE"))
        assert ledger.outbox_due(arrival_timeout=60, now=later) == []
        tx.rollback()
    assert len(ledger.outbox_due(arrival_timeout=60, now=later)) == 1
    assert ledger.outbox_due(arrival_timeout=60, now=later) == []


# -- through apply_async (memory broker) ----------------------------------------------------------------------


def _queued(app: Celery) -> int:
    with app.connection_for_write() as broker:
        return broker.default_channel.queue_declare("celery", passive=True).message_count


def _pop(app: Celery):
    with app.connection_for_write() as broker:
        return broker.default_channel.basic_get("celery")


@pytest.fixture
def app(database_url: str):
    app = Celery("outbox", broker="memory://", set_as_current=False)
    app.conf.keyed_database_url = database_url
    app.conf.keyed_send_arrival_timeout = 60
    with app.connection_for_write() as broker:  # the memory transport's queues outlive an app: start empty
        broker.default_channel.queue_declare("celery")
        broker.default_channel.queue_purge("celery")
    yield app
    close_publisher(app)
    app.close()


def test_apply_async_stores_what_it_publishes(app: Celery, ledger: Ledger, scalar) -> None:
    @keyed_task(app=app, name="outbox.t", concurrency_key="{key}", register_at_publish=True)
    def t(key: str, n: int = 0) -> None: ...

    t.apply_async(("feed:1",), {"n": 7}, task_id="a", countdown=30)
    stored = scalar("SELECT message FROM keyed_outbox WHERE task_id = 'a'")
    message = _pop(app)
    received = record_message(message, task_name="outbox.t")
    # the record a parked message would have: the same body, headers, routing (the transport adds priority 0)
    assert {**stored, "properties": None} == {**received, "properties": None}
    assert stored["properties"] == {k: v for k, v in received["properties"].items() if k != "priority"}
    assert json.loads(base64.b64decode(stored["body"]))[:2] == [["feed:1"], {"n": 7}]
    # due after the countdown + the arrival timeout, not before
    row = ledger.explain("a").facts
    assert row["due_at"] - row["registered_at"] >= timedelta(seconds=89)
    assert scalar("SELECT key FROM keyed_outbox WHERE task_id = 'a'") == "feed:1"


def test_apply_async_options(app: Celery, scalar) -> None:
    """Per call on and off; per name; unkeyed calls and retries are never registered."""
    app.conf.keyed_concurrency_limits = {"orders": {"limit": 1, "register_at_publish": True}}

    @keyed_task(app=app, name="outbox.t", concurrency_key="{key}")
    def t(key: str | None) -> None: ...

    t.apply_async(("feed:1",), task_id="plain")
    t.apply_async(("feed:1",), task_id="asked", keyed_register_at_publish=True)
    t.apply_async(("orders:1",), task_id="by-name")
    t.apply_async(("orders:1",), task_id="refused", keyed_register_at_publish=False)
    t.apply_async((None,), task_id="unkeyed", keyed_register_at_publish=True)
    t.apply_async(("feed:1",), task_id="retry", retries=1, keyed_register_at_publish=True)
    assert _queued(app) == 6
    assert scalar("SELECT array_agg(task_id ORDER BY task_id) FROM keyed_outbox") == ["asked", "by-name"]


def test_apply_async_in_the_callers_transaction(app: Celery, engine: sa.Engine, ledger: Ledger, scalar) -> None:
    """A rolled-back transaction publishes nothing and stores nothing; a committed one stores the message, and the
    relay publishes it once (a first publish, not a republish), and again only when no worker received it."""

    @keyed_task(app=app, name="outbox.t", concurrency_key="{key}", register_at_publish=True)
    def t(key: str) -> None: ...

    with engine.connect() as conn:
        tx = conn.begin()
        t.apply_async(("feed:1",), task_id="rolled-back", keyed_connection=conn)
        tx.rollback()
    assert _rows(scalar) == 0 and _queued(app) == 0
    assert relay_outbox(app, ledger, arrival_timeout=60) == {"first": 0, "republished": 0, "failed": 0}
    assert _queued(app) == 0

    with engine.begin() as conn:
        t.apply_async(("feed:1",), task_id="committed", keyed_connection=conn)
        assert _queued(app) == 0  # not before the commit
    assert relay_outbox(app, ledger, arrival_timeout=60) == {"first": 1, "republished": 0, "failed": 0}
    assert relay_outbox(app, ledger, arrival_timeout=60)["first"] == 0
    first = _pop(app)
    assert first.headers["id"] == "committed" and _queued(app) == 0
    # no worker received it: after the timeout the relay publishes the same message again
    later = datetime.now(UTC) + timedelta(seconds=61)
    assert relay_outbox(app, ledger, arrival_timeout=60, now=later) == {"first": 0, "republished": 1, "failed": 0}
    again = _pop(app)
    assert again.body == first.body and again.headers == first.headers
    # received: never again
    ledger.admit(Arrival("committed", key="feed:1"))
    assert relay_outbox(app, ledger, arrival_timeout=60, now=later + timedelta(hours=1))["republished"] == 0


def test_a_failed_publish_is_left_to_the_relay(app: Celery, ledger: Ledger, monkeypatch, scalar) -> None:
    """Once stored, the message is the ledger's to deliver: apply_async returns; the relay publishes it when due."""
    from kombu import Producer

    @keyed_task(app=app, name="outbox.t", concurrency_key="{key}", register_at_publish=True)
    def t(key: str) -> None: ...

    real = Producer.publish

    def broken(self, body, **kwargs):
        raise ConnectionError("broker down")

    monkeypatch.setattr(Producer, "publish", broken)
    result = t.apply_async(("feed:1",), task_id="stored")
    assert result.id == "stored" and _rows(scalar) == 1
    monkeypatch.setattr(Producer, "publish", real)
    later = datetime.now(UTC) + timedelta(seconds=61)
    assert relay_outbox(app, ledger, arrival_timeout=60, now=later)["republished"] == 1
    assert _pop(app).headers["id"] == "stored"


# -- visibility: celery keyed status / explain ---------------------------------------------------------------


def test_status_and_explain_show_the_outbox(database_url: str, redis_url: str, ledger: Ledger) -> None:
    from tests.integration.test_cli import run, run_json

    app = Celery("cli-outbox", broker=redis_url, set_as_current=False)
    app.conf.keyed_database_url = database_url
    try:
        ledger.register_at_publish("lost", MESSAGE, task_name="proj.sync", key="acct:1", arrival_timeout=1)
        ledger.register_at_publish("fine", MESSAGE, key="acct:2", arrival_timeout=3600)
        ledger.outbox_due(arrival_timeout=60, now=datetime.now(UTC) + timedelta(seconds=5))
        doc = run_json(app, "status")
        (acct,) = doc["outbox"]
        assert (acct["name"], acct["not_received"], acct["pending"], acct["republished_tasks"],
                acct["republished"]) == ("acct", 2, 0, 1, 1)
        out = run(app, "status").stdout
        assert "REGISTERED NOT RECEIVED" in out
        assert any(x.split()[:5] == ["acct", "2", "0", "1", "1"] for x in out.splitlines())
        told = run(app, "explain", "lost").stdout
        assert "lost: outbox" in told
        assert "not received by a worker yet, republished 1 time;" in told
        assert run_json(app, "explain", "lost")["facts"]["republished"] == 1
    finally:
        close_publisher(app)
        app.close()


def test_a_grouped_task_is_republished_before_its_number_is_lost(app: Celery, ledger: Ledger, clock, scalar) -> None:
    """A group number not received within keyed_group_arrival_timeout is recorded lost (D10), and a lost number is
    never republished: a task of an ordered group is due after half the group's timeout at most."""
    app.conf.keyed_group_arrival_timeout = 300

    @keyed_task(app=app, name="outbox.g", group_key="{group}", register_at_publish=True)
    def g(group: str) -> None: ...

    g.apply_async(("order:1",), task_id="g1")
    waited = scalar("SELECT EXTRACT(EPOCH FROM due_at - registered_at) FROM keyed_outbox WHERE task_id = 'g1'")
    assert float(waited) == 60.0  # keyed_send_arrival_timeout (60 here) is already below 300 / 2
    app.conf.keyed_send_arrival_timeout = 3600
    close_publisher(app)  # settings are read once per publisher
    g.apply_async(("order:2",), task_id="g2")
    waited = scalar("SELECT EXTRACT(EPOCH FROM due_at - registered_at) FROM keyed_outbox WHERE task_id = 'g2'")
    assert float(waited) == 150.0
    # the relay's next period for a grouped task is its own shorter timeout, doubled
    with ledger.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM keyed_outbox"))
    ledger.register_at_publish("g3", MESSAGE, group_key="order:3", arrival_timeout=150, now=clock())
    (due,) = ledger.outbox_due(arrival_timeout=3600, grouped_timeout=150, now=clock.advance(151))
    assert due.task_id == "g3"
    assert ledger.outbox_due(arrival_timeout=3600, grouped_timeout=150, now=clock.advance(299)) == []
    assert [d.task_id for d in ledger.outbox_due(arrival_timeout=3600, grouped_timeout=150,
                                                 now=clock.advance(2))] == ["g3"]


def test_the_relay_counts_what_it_publishes(app: Celery, ledger: Ledger) -> None:
    from celery_keyed import metrics

    if not metrics.enabled():
        pytest.skip("prometheus_client is not installed")

    def count(kind: str) -> float:
        return metrics.OUTBOX_PUBLISHED.labels(kind=kind)._value.get()

    before = {kind: count(kind) for kind in ("first", "republished", "failed")}
    ledger.register_at_publish("m", MESSAGE, key="feed:1", arrival_timeout=1)
    relay_outbox(app, ledger, arrival_timeout=60, now=datetime.now(UTC) + timedelta(seconds=2))
    assert {kind: count(kind) - before[kind] for kind in before} == {"first": 0, "republished": 1, "failed": 0}
