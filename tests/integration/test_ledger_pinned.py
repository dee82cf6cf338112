"""``Ledger.pinned``: a worker's service thread (admission, releaser) keeps one autocommit connection between its
self-committing calls instead of checking one out of the pool and back for each (about 75 µs of the worker's main
process CPU per call, docs/benchmarks.md). What must hold: the calls inside the context share one connection, the
connection goes back to the pool when the context ends, a thread without a pin (or another thread) is not
affected, and a pinned connection the server dropped fails one call at most and is never used again."""

from __future__ import annotations

import threading
import uuid

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger, Outcome, Token, Verdict


def _checkouts(engine: sa.Engine) -> list[int]:
    seen: list[int] = []
    sa.event.listen(engine, "checkout", lambda dbapi, record, proxy: seen.append(id(dbapi)))
    return seen


def _cycle(ledger: Ledger, key: str) -> None:
    task_id = f"t-{uuid.uuid4().hex[:10]}"
    admission = ledger.admit(Arrival(task_id=task_id, key=key))
    assert admission.verdict is Verdict.ADMITTED
    report = ledger.release(Token(task_id, 0), admission.fence or 0, Outcome.COMPLETED)
    assert report.released


def test_calls_inside_the_context_share_one_connection_and_give_it_back(engine: sa.Engine) -> None:
    ledger = Ledger(engine)
    checkouts = _checkouts(engine)
    for i in range(3):
        _cycle(ledger, f"unpinned:{i}")
    unpinned = len(checkouts)
    assert unpinned >= 6  # the control: a claim and a release each check a connection out
    checkouts.clear()
    with ledger.pinned():
        for i in range(5):
            _cycle(ledger, f"pinned:{i}")
        assert engine.pool.checkedout() == 1  # type: ignore[attr-defined]
        with ledger.pinned():  # nested: the same pin
            _cycle(ledger, "pinned:nested")
    assert len(checkouts) == 1
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]  # back in the pool at the end


def test_another_thread_is_not_pinned(engine: sa.Engine) -> None:
    ledger = Ledger(engine)
    checkouts = _checkouts(engine)
    done = threading.Event()
    with ledger.pinned():
        _cycle(ledger, "mine")
        mine = len(checkouts)

        def other() -> None:
            _cycle(ledger, "theirs:0")
            _cycle(ledger, "theirs:1")
            done.set()

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(timeout=30)
        assert done.is_set()
        assert len(checkouts) - mine >= 4  # the other thread checked out per call
        assert engine.pool.checkedout() == 1  # type: ignore[attr-defined]  # only the pin is out


def test_a_dropped_pinned_connection_fails_one_call_at_most_then_a_new_one_is_used(engine: sa.Engine) -> None:
    ledger = Ledger(engine)
    failures = 0
    with ledger.pinned():
        _cycle(ledger, "before")
        pid = ledger.autocommitted(lambda conn: conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
        with engine.connect() as admin:
            assert admin.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar_one()
        for i in range(3):
            try:
                _cycle(ledger, f"after:{i}")
            except sa.exc.DBAPIError:
                failures += 1
        new_pid = ledger.autocommitted(lambda conn: conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
    assert failures <= 1
    assert new_pid != pid
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]


def test_a_statement_through_sqlalchemy_leaves_no_transaction_open_on_the_pin(engine: sa.Engine) -> None:
    """SQLAlchemy autobegins on ``conn.execute`` even in autocommit; the pin ends it after each call, so the next
    call is not run inside it (and an error in one call does not leave the pin unusable)."""
    ledger = Ledger(engine)
    with ledger.pinned():
        assert ledger.autocommitted(lambda conn: conn.execute(sa.text("SELECT 1")).scalar_one()) == 1
        assert not ledger.autocommitted(lambda conn: conn.in_transaction())
        with pytest.raises(sa.exc.DBAPIError):
            ledger.autocommitted(lambda conn: conn.execute(sa.text("SELECT 1/0")).scalar_one())
        assert ledger.autocommitted(lambda conn: conn.execute(sa.text("SELECT 2")).scalar_one()) == 2
        _cycle(ledger, "still-usable")


def _ledger_rows(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        tables = conn.execute(
            sa.text("SELECT tablename FROM pg_tables WHERE schemaname = current_schema() AND tablename LIKE 'keyed%'")
        ).scalars().all()
        return {t: conn.execute(sa.text(f'SELECT count(*) FROM "{t}"')).scalar_one() for t in tables}


def test_warm_up_runs_the_hot_path_on_the_pinned_connection_and_leaves_nothing(engine: sa.Engine) -> None:
    """The warm-up claims, parks and releases on a key of its own inside a block it rolls back: every ledger
    table has the rows it had, the pin it warmed is the connection the thread goes on with, and the hot path works
    after it."""
    ledger = Ledger(engine)
    _cycle(ledger, "before")  # the tables the warm-up touches have rows of their own
    before = _ledger_rows(engine)
    checkouts = _checkouts(engine)
    with ledger.pinned():
        assert ledger.warm_up()  # claimed, parked, released, and the parked one promoted to this holder
        pid = ledger.autocommitted(lambda conn: conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
        assert not ledger.autocommitted(lambda conn: conn.in_transaction())
        _cycle(ledger, "before")  # the same key: no key or slot rows of its own
        assert ledger.autocommitted(lambda conn: conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()) == pid
    assert len(checkouts) == 1
    after = _ledger_rows(engine)
    grown = {t: (before[t], after[t]) for t in after if after[t] != before.get(t)}
    assert set(grown) <= {"keyed_tasks"}, grown  # only the second cycle's own task row
    assert after["keyed_tasks"] == before["keyed_tasks"] + 1
    with engine.connect() as conn:
        assert not conn.execute(sa.text("SELECT count(*) FROM keyed_tasks WHERE key LIKE 'keyed-warm-up%'")).scalar()


def test_warm_up_never_raises_when_the_database_cannot_be_reached() -> None:
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:9/none", connect_args={"connect_timeout": 1})
    try:
        ledger = Ledger(engine)
        with ledger.pinned():
            assert not ledger.warm_up()  # logged at debug level, not raised: the breaker hears of it from a real call
            with pytest.raises(sa.exc.OperationalError):
                ledger.autocommitted(lambda conn: conn.execute(sa.text("SELECT 1")).scalar_one())
    finally:
        engine.dispose()


def test_a_worker_keeps_room_in_its_pool_for_the_pinned_threads(database_url: str) -> None:
    """With ``keyed_pool_size = 1`` (one connection, one more in overflow) the three pinned threads would take every
    connection a worker may open and leave the heartbeat waiting for one (self-fencing its running tasks): the
    gate's engine keeps ``PINNED_THREADS`` connections more, so with every thread pinned the heartbeat's and the
    loop's calls still get theirs."""
    from types import SimpleNamespace

    from celery import Celery

    from celery_keyed.gate import PINNED_THREADS, GateService
    from celery_keyed.settings import read_settings

    app = Celery("pinned-room", broker="memory://", set_as_current=False)
    app.conf.update(keyed_database_url=database_url, keyed_pool_size=1, keyed_connect_timeout=1)
    consumer = SimpleNamespace(hostname="pinned-room", timer=None, strategies={}, pool=None)
    gate = GateService(app, consumer, read_settings(app.conf))
    try:
        assert PINNED_THREADS == 3
        assert gate.engine.pool.size() == 1 + PINNED_THREADS  # type: ignore[attr-defined]
        pinned = threading.Barrier(PINNED_THREADS + 1)
        done = threading.Event()

        def service_thread() -> None:
            with gate.ledger.pinned():
                gate.ledger.warm_up()
                pinned.wait(timeout=10)
                done.wait(timeout=30)

        threads = [threading.Thread(target=service_thread) for _ in range(PINNED_THREADS)]
        for thread in threads:
            thread.start()
        pinned.wait(timeout=10)
        try:
            # two more calls at once (the heartbeat and the loop): keyed_pool_size 1 and its overflow
            _cycle(gate.ledger, "room:1")
            with gate.engine.connect() as one, gate.engine.connect() as two:
                assert one.execute(sa.text("SELECT 1")).scalar_one() == two.execute(sa.text("SELECT 1")).scalar_one()
        finally:
            done.set()
            for thread in threads:
                thread.join(timeout=10)
    finally:
        gate.engine.dispose()
