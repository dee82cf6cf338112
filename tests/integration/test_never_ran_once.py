"""The result of a task that never ran is stored once, errbacks called once, however many notifiers run at once.

Every worker's sweep, the consumer loop right after a revoke or a refusal, and the heartbeat all store never-ran
results (D11). Two of them reading the same unnotified row and both storing it called the task's errbacks twice (a
revoked chain member, two workers receiving the revoke broadcast). These tests race two notifiers of two worker
processes (two ledger holders) on one real PostgreSQL database, with a real Redis result backend; the backend's
``mark_as_failure`` is only wrapped to count its calls and to hold the first one open while the other notifier runs.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_keyed import KeyedRejected, KeyedRevoked
from celery_keyed.ledger import Arrival, Ledger, NameConfig, Verdict
from celery_keyed.ledger.never_ran import take_never_ran
from celery_keyed.worker.sweeper import Sweeper
from celery_keyed.worker.verdicts import Verdicts

WAIT = 20.0


class Backend:
    """Counts the real backend's ``mark_as_failure`` calls; ``hold`` keeps the next call open until ``go``."""

    def __init__(self, app: Celery) -> None:
        self.real = app.backend.mark_as_failure
        self.stored: list[str] = []
        self.fail = False
        self.hold = False
        self.entered = threading.Event()
        self.go = threading.Event()
        app.backend.mark_as_failure = self  # type: ignore[method-assign]

    def __call__(self, task_id: str, exc: BaseException, *args: Any, **kwargs: Any) -> Any:
        if self.hold:
            self.hold = False
            self.entered.set()
            assert self.go.wait(WAIT)
        if self.fail:
            raise ConnectionError("result backend out of reach")
        self.stored.append(task_id)
        return self.real(task_id, exc, *args, **kwargs)


@pytest.fixture
def app(redis_url: str) -> Iterator[Celery]:
    app = Celery("never-ran", broker="memory://", backend=redis_url, set_as_current=False)
    app.conf.result_expires = 60
    app.conf.result_backend_thread_safe = True  # one backend object for every thread (the wrapper counts all)
    errbacks: list[str] = []

    @app.task(name="never_ran.on_error", shared=False)
    def on_error(request: Any, exc: BaseException, traceback: Any) -> None:
        errbacks.append(request.id)  # called in the storing process: Celery calls a 3-argument errback directly

    app.errbacks = errbacks  # type: ignore[attr-defined]
    app.finalize()
    yield app
    app.backend.client.connection_pool.disconnect()


def _record(app: Celery, task_id: str) -> dict[str, Any]:
    """A stored message as the ledger keeps it for a parked task, with the errback its producer linked."""
    errback = app.signature("never_ran.on_error")
    body = json.dumps([[], {}, {"errbacks": [dict(errback)], "callbacks": None, "chain": None, "chord": None}])
    return {
        "headers": {"id": task_id, "task": "never_ran.parked"},
        "properties": {},
        "content_type": "application/json",
        "body": base64.b64encode(body.encode()).decode(),
    }


def _revoked_while_parked(app: Celery, first: Ledger, case: str) -> str:
    """A task parked behind a holder of its K = 1 key, then revoked: a never-ran row with its stored message."""
    first.configure({"nr": NameConfig("nr", limit=1)})
    key = f"nr:{case}"
    assert first.admit(Arrival(f"{case}-holder", key=key, message={"id": "h"})).verdict is Verdict.ADMITTED
    parked = f"{case}-parked"
    assert first.admit(Arrival(parked, key=key, message=_record(app, parked))).verdict is Verdict.PARKED
    first.revoke(parked)
    return parked


def _sweeper(app: Celery, ledger: Ledger) -> Sweeper:
    settings = SimpleNamespace(sweep_interval=60.0, lease=30.0)
    return Sweeper(
        app=app, settings=settings, ledger=ledger, breaker=None, handoff=None, announce_never_ran=lambda *a: None
    )


def _notified(engine: sa.Engine, task_id: str) -> bool:
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT notified FROM keyed_tasks WHERE task_id = :t"), {"t": task_id})
        return bool(row.scalar())


@pytest.fixture
def two_workers(engine: sa.Engine) -> tuple[Ledger, Ledger]:
    return (
        Ledger(engine, holder="host-a:1:aaaa", lease=30.0, dispatch=10.0),
        Ledger(engine, holder="host-b:2:bbbb", lease=30.0, dispatch=10.0),
    )


def test_two_sweeps_at_once_store_a_revoked_result_once_and_call_its_errback_once(
    app: Celery, engine: sa.Engine, two_workers: tuple[Ledger, Ledger]
) -> None:
    """Worker A's sweep is storing the result (the backend call is held open) when worker B's sweep runs: B skips
    the row A holds, A marks it notified with the store; a later sweep of either finds nothing to store."""
    first, second = two_workers
    task_id = _revoked_while_parked(app, first, "race")
    backend = Backend(app)
    backend.hold = True
    a, b = _sweeper(app, first), _sweeper(app, second)
    errors: list[BaseException] = []

    def sweep_a() -> None:
        try:
            a.notify_never_ran()
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=sweep_a)
    thread.start()
    try:
        assert backend.entered.wait(WAIT)
        b.notify_never_ran()  # while A stores: A's row is locked, B skips it
        assert backend.stored == [] and not _notified(engine, task_id)
    finally:
        backend.go.set()
        thread.join(WAIT)
    assert errors == []
    assert backend.stored == [task_id] and _notified(engine, task_id)
    b.notify_never_ran()
    a.notify_never_ran()
    assert backend.stored == [task_id]
    assert app.errbacks == [task_id]  # type: ignore[attr-defined]
    with pytest.raises(KeyedRevoked):
        app.AsyncResult(task_id).get(timeout=WAIT)


def test_a_notifier_of_given_tasks_waits_for_the_one_storing_them_and_stores_nothing_more(
    app: Celery, engine: sa.Engine, two_workers: tuple[Ledger, Ledger]
) -> None:
    """The revoke broadcast reaches both workers; A's sweep is storing the revoked task's result when B's revoke
    command asks for it. B waits for A (Celery's revoke handler, which B runs next, stores REVOKED over a task
    without a result: B must not return before the KeyedRevoked result is stored), then finds it notified and
    stores nothing. The worker that refused a task (``Verdicts._store_once``) waits the same way."""
    first, second = two_workers
    task_id = _revoked_while_parked(app, first, "wait")
    backend = Backend(app)
    backend.hold = True
    a, b = _sweeper(app, first), _sweeper(app, second)
    thread = threading.Thread(target=a.notify_never_ran)
    thread.start()
    b_done = threading.Event()
    results: list[Any] = []

    def revoke_command_b() -> None:
        b.notify_never_ran([task_id])
        results.append(app.backend.get_state(task_id))  # what Celery's revoke handler would read next
        b_done.set()

    waiter = threading.Thread(target=revoke_command_b)
    try:
        assert backend.entered.wait(WAIT)
        waiter.start()
        assert not b_done.wait(0.5)  # B waits while A stores
    finally:
        backend.go.set()
        thread.join(WAIT)
        waiter.join(WAIT)
    assert b_done.is_set() and results == ["FAILURE"]
    assert backend.stored == [task_id] and app.errbacks == [task_id]  # type: ignore[attr-defined]

    verdicts = Verdicts(
        app=app, ledger=second, releaser=None, sweeper=None, announce_parked=lambda *a: None,
        announce_never_ran=lambda *a: None,
    )
    calls: list[str] = []
    assert not verdicts._store_once(task_id, "revoked", lambda: calls.append(task_id))  # stored already
    assert verdicts._store_once("never-booked", "rejected", lambda: calls.append("never-booked"))  # nobody else will
    assert calls == ["never-booked"]


def test_a_notifier_of_given_tasks_waits_a_bounded_time(
    app: Celery, engine: sa.Engine, two_workers: tuple[Ledger, Ledger]
) -> None:
    """A notifier whose store hangs does not hold another worker's loop for longer than the wait: the other one
    leaves the row to it (and stores nothing)."""
    first, _ = two_workers
    task_id = _revoked_while_parked(app, first, "bounded")
    with first.take_never_ran() as held:
        assert [r.task_id for r in held.rows] == [task_id]
        with take_never_ran(engine, [task_id], wait=0.2) as other:
            assert other.rows == [] and other.unknown == set()
        held.stored(task_id)
    assert _notified(engine, task_id)


def test_a_malformed_message_refused_by_two_workers_stores_one_result(
    app: Celery, engine: sa.Engine, two_workers: tuple[Ledger, Ledger]
) -> None:
    """A foreign producer's message that cannot be read, delivered to two workers (a redelivery): both record it
    rejected, one stores its result. The row is notified only by the one that stored it."""
    backend = Backend(app)
    first, second = two_workers
    workers = [
        Verdicts(
            app=app, ledger=ledger, releaser=None, sweeper=None, announce_parked=lambda *a: None,
            announce_never_ran=lambda *a: None,
        )
        for ledger in (first, second)
    ]
    for verdicts in workers:
        verdicts.refuse_malformed("malformed-1", "never_ran.parked", "its keys cannot be read", None)
    assert backend.stored == ["malformed-1"] and _notified(engine, "malformed-1")
    with pytest.raises(KeyedRejected):
        app.AsyncResult("malformed-1").get(timeout=WAIT)


def test_a_store_that_fails_leaves_the_row_for_the_next_sweep(
    app: Celery, engine: sa.Engine, two_workers: tuple[Ledger, Ledger]
) -> None:
    """The backend out of reach: nothing is marked notified, the next sweep stores it (before, the row was marked
    notified with its result never stored)."""
    first, _ = two_workers
    task_id = _revoked_while_parked(app, first, "fails")
    backend = Backend(app)
    backend.fail = True
    sweeper = _sweeper(app, first)
    sweeper.notify_never_ran()
    assert backend.stored == [] and not _notified(engine, task_id)
    backend.fail = False
    sweeper.notify_never_ran()
    assert backend.stored == [task_id] and _notified(engine, task_id)
    assert app.errbacks == [task_id]  # type: ignore[attr-defined]


def test_a_refusal_at_arrival_is_left_to_the_worker_that_refused_it_for_a_grace(
    app: Celery, engine: sa.Engine, ledger: Ledger
) -> None:
    """A row without a stored message (refused at arrival: the refusing worker holds the request's errbacks) is
    not taken by a sweep until it is a few seconds old; then the sweep stores it from the books."""
    ledger.configure({"full": NameConfig("full", limit=1, max_waiting=0)})
    assert ledger.admit(Arrival("holder", key="full:1", message={"id": "h"})).verdict is Verdict.ADMITTED
    assert ledger.admit(Arrival("refused", key="full:1", message={"id": "r"})).verdict is Verdict.REJECTED
    with take_never_ran(engine) as taken:
        assert taken.rows == []
    later = datetime.now(UTC) + timedelta(seconds=60)
    with take_never_ran(engine, now=later) as taken:
        assert [r.task_id for r in taken.rows] == ["refused"] and taken.rows[0].message is None
    with ledger.take_never_ran(["refused"]) as taken:  # the refusing worker's own call: at once
        assert [r.task_id for r in taken.rows] == ["refused"]
