"""Refusal at send (issue 14 item 3) on real Postgres: the room and the dedupe key are decided by
``keyed_admit_at_send`` under locks, so concurrent senders (threads with their own connections, and processes)
never get more accepted than the room, never two live tasks with one dedupe key; the books balance."""

from __future__ import annotations

import multiprocessing
import threading
from collections import Counter

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_keyed import KeyedRejected, keyed_task
from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict
from celery_keyed.publisher import close_publisher


def _configure(ledger: Ledger, clock, **options) -> None:
    ledger.configure({"feed": NameConfig("feed", limit=1, **options)}, now=clock())


def test_room_counts_parked_and_sent(ledger: Ledger, clock) -> None:
    """max_waiting 2, limit 1: a running task takes no place; a sent one and a parked one take one each."""
    _configure(ledger, clock, max_waiting=2)
    assert ledger.admit_at_send("a", "feed:1", now=clock()).accepted
    assert ledger.admit(Arrival("a", key="feed:1"), now=clock()).verdict is Verdict.ADMITTED  # running: no place
    assert ledger.admit_at_send("b", "feed:1", now=clock()).accepted
    assert ledger.admit_at_send("c", "feed:1", now=clock()).accepted
    refused = ledger.admit_at_send("d", "feed:1", now=clock())
    assert (refused.accepted, refused.reason) == (False, "room_full")
    assert "1 waiting" not in refused.detail and "2 sent" in refused.detail
    # b parks: it moves from "sent" to "waiting" in one transaction; the room stays full
    assert ledger.admit(Arrival("b", key="feed:1"), now=clock()).verdict is Verdict.PARKED
    assert not ledger.admit_at_send("d", "feed:1", now=clock()).accepted
    # another key of the name has a room of its own
    assert ledger.admit_at_send("x", "feed:2", now=clock()).accepted
    # a refused send booked nothing: the books know a and b only
    assert ledger.books() == {"open": 2, "arrivals": 2}
    assert {s.name: (s.in_flight, s.refused_full) for s in ledger.sends(now=clock())} == {"feed": (2, 2)}


def test_the_same_task_id_is_accepted_again(ledger: Ledger, clock) -> None:
    """A retry (same task id, still open) or a re-send of an accepted id reserves nothing more."""
    _configure(ledger, clock, max_waiting=1)
    assert ledger.admit_at_send("a", "feed:1", now=clock()).accepted
    again = ledger.admit_at_send("a", "feed:1", now=clock())
    assert (again.accepted, again.detail) == (True, "known")
    assert not ledger.admit_at_send("b", "feed:1", now=clock()).accepted


def test_unbounded_room_and_supersede_never_refuse_for_room(ledger: Ledger, clock) -> None:
    assert all(ledger.admit_at_send(f"t{i}", "plain:1", now=clock()).accepted for i in range(5))  # no config
    ledger.configure({"sup": NameConfig("sup", limit=1, max_waiting=1, overflow="supersede")}, now=clock())
    assert all(ledger.admit_at_send(f"s{i}", "sup:1", now=clock()).accepted for i in range(3))


def test_dedupe_key_live_until_the_final_outcome(ledger: Ledger, clock) -> None:
    _configure(ledger, clock)
    assert ledger.admit_at_send("a", "feed:1", dedupe_key="order:7", now=clock()).accepted
    dup = ledger.admit_at_send("b", "feed:2", dedupe_key="order:7", now=clock())
    assert (dup.accepted, dup.reason, dup.holder_task_id) == (False, "duplicate", "a")
    a = ledger.admit(Arrival("a", key="feed:1"), now=clock())
    assert not ledger.admit_at_send("b", "feed:1", dedupe_key="order:7", now=clock()).accepted  # running
    # a retry keeps the task open: still live
    ledger.release(Token("a", 0), a.fence, Outcome.RETRY, now=clock())
    assert not ledger.admit_at_send("b", "feed:1", dedupe_key="order:7", now=clock()).accepted
    a1 = ledger.admit(Arrival("a", attempt=1, key="feed:1"), now=clock())
    ledger.release(Token("a", 1), a1.fence, Outcome.COMPLETED, now=clock())
    assert ledger.admit_at_send("b", "feed:1", dedupe_key="order:7", now=clock()).accepted  # a is over
    assert {s.name: s.refused_duplicate for s in ledger.sends(now=clock())} == {"feed": 3}


def test_a_send_that_never_arrives_gives_its_place_back(ledger: Ledger, clock, scalar) -> None:
    """The broker lost it: after the arrival timeout it neither fills the room nor holds its dedupe key, and
    reconcile drops its row; a finished task's row is dropped too."""
    _configure(ledger, clock, max_waiting=1)
    assert ledger.admit_at_send("lost", "feed:1", dedupe_key="d", arrival_timeout=60, now=clock())
    assert not ledger.admit_at_send("b", "feed:1", arrival_timeout=60, now=clock()).accepted
    later = clock.advance(61)
    assert ledger.admit_at_send("b", "feed:1", dedupe_key="d", arrival_timeout=60, now=later).accepted
    b = ledger.admit(Arrival("b", key="feed:1"), now=later)
    ledger.release(Token("b", 0), b.fence, Outcome.COMPLETED, now=later)
    report = ledger.reconcile(now=later)
    assert report.sends_dropped == 2
    assert scalar("SELECT count(*) FROM keyed_sent") == 0


def test_forget_send_gives_the_place_back(ledger: Ledger, clock) -> None:
    _configure(ledger, clock, max_waiting=1)
    assert ledger.admit_at_send("a", "feed:1", now=clock()).accepted
    ledger.forget_send("a")
    assert ledger.admit_at_send("b", "feed:1", now=clock()).accepted


def _race(engine: sa.Engine, clock, calls: list[tuple[str, str | None]], key: str = "feed:1") -> list[str]:
    """Run every (task_id, dedupe_key) send at once, each thread with its own connection; the accepted ids."""
    barrier = threading.Barrier(len(calls))
    accepted: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def send(task_id: str, dedupe: str | None) -> None:
        own = Ledger(engine, holder=f"sender:{task_id}:0")
        try:
            barrier.wait()
            verdict = own.admit_at_send(task_id, key, dedupe_key=dedupe, now=clock())
            if verdict.accepted:
                with lock:
                    accepted.append(task_id)
        except BaseException as exc:  # reported below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=send, args=call) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    return accepted


def test_race_never_more_accepted_than_the_room(database_url: str, ledger: Ledger, clock) -> None:
    _configure(ledger, clock, max_waiting=5)
    engine = sa.create_engine(database_url, pool_size=24, max_overflow=0)
    try:
        for round_ in range(3):
            accepted = _race(engine, clock, [(f"r{round_}-{i}", None) for i in range(24)], key=f"feed:{round_}")
            assert len(accepted) == 5, accepted
    finally:
        engine.dispose()


def test_race_one_live_task_per_dedupe_key(database_url: str, ledger: Ledger, clock) -> None:
    _configure(ledger, clock)
    engine = sa.create_engine(database_url, pool_size=24, max_overflow=0)
    try:
        for round_ in range(3):
            accepted = _race(engine, clock, [(f"d{round_}-{i}", f"order:{round_}") for i in range(24)])
            assert len(accepted) == 1, accepted
    finally:
        engine.dispose()


def _send_in_process(url: str, task_ids: list[str], start: multiprocessing.synchronize.Event, out) -> None:
    engine = sa.create_engine(url)
    ledger = Ledger(engine)
    start.wait()
    out.put([t for t in task_ids if ledger.admit_at_send(t, "feed:p", dedupe_key=None).accepted])
    engine.dispose()


def test_race_across_processes(database_url: str, ledger: Ledger, clock, scalar) -> None:
    """Four processes, eight sends each, a room of 6: exactly 6 accepted; the room then fills with them as they
    park, the one that runs leaves a place; the books balance over what arrived."""
    ledger.configure({"feed": NameConfig("feed", limit=1, max_waiting=6)})
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_send_in_process, args=(database_url, [f"p{p}-{i}" for i in range(8)], start, out))
        for p in range(4)
    ]
    for p in procs:
        p.start()
    start.set()
    accepted = [t for _ in procs for t in out.get(timeout=60)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(accepted) == 6, accepted
    # every accepted send arrives: the first runs, five park (the room had a place for each: none is rejected)
    verdicts = Counter(ledger.admit(Arrival(t, key="feed:p")).verdict for t in accepted)
    assert verdicts == {Verdict.ADMITTED: 1, Verdict.PARKED: 5}
    assert scalar("SELECT waiting FROM keyed_keys WHERE key = 'feed:p'") == 5
    assert ledger.admit_at_send("late", "feed:p").accepted  # the running one left the room: one place
    assert not ledger.admit_at_send("later", "feed:p").accepted
    assert ledger.books() == {"open": 6, "arrivals": 6}


def test_books_balance_with_sends(ledger: Ledger, clock) -> None:
    """Accepted sends arrive and finish as any task; refused ones are not in the books; one outcome per task id."""
    _configure(ledger, clock, max_waiting=1, max_wait=5)
    assert [ledger.admit_at_send(t, "feed:1", now=clock()).accepted for t in "abc"] == [True, False, False]
    a = ledger.admit(Arrival("a", key="feed:1"), now=clock())
    assert ledger.admit_at_send("d", "feed:1", now=clock()).accepted  # a runs: its place is free
    assert ledger.admit(Arrival("d", key="feed:1"), now=clock()).verdict is Verdict.PARKED
    (p,) = ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED, now=clock()).promotions
    fence = ledger.bind(p.token, p.nonce, now=clock())
    ledger.release(p.token, fence, Outcome.COMPLETED, now=clock())
    ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED, now=clock())  # a second release: nothing
    assert ledger.books() == {"completed": 2, "arrivals": 2}
    assert ledger.reconcile(now=clock()).sends_dropped == 2
    assert [(s.in_flight, s.refused_full) for s in ledger.sends(now=clock())] == [(0, 2)]


def test_explain_a_send_not_arrived(ledger: Ledger, clock) -> None:
    _configure(ledger, clock, max_waiting=3)
    assert ledger.admit_at_send("a", "feed:1", dedupe_key="order:1", arrival_timeout=60, now=clock()).accepted
    told = ledger.explain("a", now=clock())
    assert told.state == "sent" and "holds a place in the waiting room of feed:1 (dedupe key order:1)" in told.text
    assert "lapsed" in ledger.explain("a", now=clock.advance(61)).text
    ledger.admit(Arrival("a", key="feed:1"), now=clock())
    assert ledger.explain("a", now=clock()).state == "running"


def test_apply_async_in_the_callers_transaction(database_url: str, engine: sa.Engine, ledger: Ledger, scalar) -> None:
    """``keyed_connection=conn``: the check runs in the caller's transaction; its reservation rolls back with it, and
    a refusal raises KeyedRejected before anything is published (memory broker: nothing in the queue)."""
    app = Celery("send", broker="memory://", set_as_current=False)
    app.conf.keyed_database_url = database_url

    @keyed_task(app=app, name="send.t", concurrency_key="{key}", admit_at_send=True)
    def t(key: str) -> None: ...

    ledger.configure({"feed": NameConfig("feed", limit=1, max_waiting=1)})
    try:
        conn = engine.connect()
        tx = conn.begin()
        t.apply_async(("feed:1",), task_id="in-tx", keyed_connection=conn)
        tx.rollback()
        conn.close()
        assert scalar("SELECT count(*) FROM keyed_sent") == 0  # rolled back with the caller's transaction
        with engine.begin() as conn:
            t.apply_async(("feed:1",), task_id="kept", keyed_connection=conn)
        assert scalar("SELECT task_id FROM keyed_sent") == "kept"
        with app.connection_for_write() as broker:
            queued = broker.default_channel.queue_declare("celery", passive=True).message_count
        with pytest.raises(KeyedRejected):
            t.apply_async(("feed:1",), task_id="refused")
        with app.connection_for_write() as broker:
            assert broker.default_channel.queue_declare("celery", passive=True).message_count == queued
    finally:
        close_publisher(app)
        app.close()


def test_sends_are_counted_by_verdict(database_url: str, ledger: Ledger) -> None:
    """``celery_keyed_sends{verdict}``: what this process's refusal-at-send checks answered."""
    prometheus_client = pytest.importorskip("prometheus_client")
    app = Celery("send-metrics", broker="memory://", set_as_current=False)
    app.conf.keyed_database_url = database_url

    @keyed_task(app=app, name="send.m", concurrency_key="{key}", admit_at_send=True)
    def m(key: str) -> None: ...

    ledger.configure({"feed": NameConfig("feed", limit=1, max_waiting=1)})

    def count(verdict: str) -> float:
        return prometheus_client.REGISTRY.get_sample_value("celery_keyed_sends_total", {"verdict": verdict}) or 0.0

    before = {v: count(v) for v in ("accepted", "known", "room_full")}
    try:
        m.apply_async(("feed:2",), task_id="m-1")  # a place in the waiting room (max_waiting 1)
        m.apply_async(("feed:2",), task_id="m-1")  # the same task id again: it has its place
        with pytest.raises(KeyedRejected):
            m.apply_async(("feed:2",), task_id="m-2")  # the room is full
    finally:
        close_publisher(app)
        app.close()
    assert {v: count(v) - before[v] for v in before} == {"accepted": 1, "known": 1, "room_full": 1}
