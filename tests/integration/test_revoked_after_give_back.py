"""A revoke that finds no claim still closes the books (D11, D15). A claim taken ahead at receipt, revoked while its
request waits for a pool process, given back by the heartbeat (no process took it in time), and then reached by a
pool process: Celery discards the request as revoked and stores REVOKED. The ledger booked nothing — the revoke's
broadcast found the claim running ("its worker releases it"), the give-back booked "worker lost" (a redelivery would
be admitted again) — so the task stayed open for ever. Now the gate stores the revoke again when it finds no claim to
give back, and reconcile settles an idle open task whose stored result is REVOKED."""

from __future__ import annotations

import time
import warnings

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.exceptions import TaskRevokedError
from celery.utils.collections import LimitedSet
from celery.worker import state as worker_state

import celery_keyed
from celery_keyed import beat
from celery_keyed.gate import GateService
from celery_keyed.ledger import Arrival, Ledger, Token, Verdict
from celery_keyed.publisher import close_publisher
from tests.integration.test_claim_ahead import _claims, _loop_turn, _receive, _request
from tests.integration.test_claim_ahead import gate as gate  # the fixture


def _outcome(engine: sa.Engine, task_id: str) -> str | None:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT outcome FROM keyed_tasks WHERE task_id = :t"), {"t": task_id}).scalar()


def test_a_claim_ahead_revoked_then_given_back_is_booked_revoked_when_celery_discards_it(
    gate: GateService, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    handled: list[str] = []
    request = _request("rv", "acct:5")
    _receive(gate, request, handled)
    _loop_turn(gate, handled, 1)
    assert set(_claims(engine)) == {"rv"}  # claimed ahead, waiting for the busy pool process

    revoked = LimitedSet()
    monkeypatch.setattr(worker_state, "revoked", revoked)
    gate.revokes.record(["rv"])  # the broadcast: stored first, the claim is running, so its worker releases it
    revoked.add("rv")  # then Celery's own handler
    assert _outcome(engine, "rv") is None

    gate.handoff.prebound[Token("rv", 0)].since -= gate.settings.heartbeat_interval
    gate.heartbeat_once()  # no pool process took it in time: the claim goes back (worker lost)
    deadline = time.monotonic() + 10
    while "rv" in _claims(engine):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert _outcome(engine, "rv") is None

    discarded: list[str] = []
    request.revoked = lambda: discarded.append("rv")  # Celery's bookkeeping: ack, REVOKED result
    with pytest.raises(TaskRevokedError):
        gate.execute(request, lambda: pytest.fail("a revoked request must not start"))
    assert discarded == ["rv"]
    gate.heartbeat_once()  # stores the revokes the loop handed on
    assert _outcome(engine, "rv") == "revoked"  # was open for ever
    assert _claims(engine) == {}


def test_reconcile_settles_an_idle_open_task_whose_stored_result_is_revoked(
    database_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The books' backstop (D15): an open task with no claim and no waiting row whose result backend holds REVOKED
    is booked revoked by reconcile (it settled SUCCESS and FAILURE only), and stays settled."""
    app = Celery("revoked-test", broker=redis_url, backend=redis_url, set_as_current=False)
    app.conf.keyed_database_url = database_url
    app.conf.keyed_lease = 1.0
    celery_keyed.install(app)
    monkeypatch.setattr(beat, "_last_unreachable", float("-inf"))
    engine = sa.create_engine(database_url)
    try:
        dead_worker = Ledger(engine, lease=1.0)
        for task_id in ("revoked", "retrying"):
            assert dead_worker.admit(Arrival(task_id, key=f"k:{task_id}", message={})).verdict is Verdict.ADMITTED
        time.sleep(1.2)  # both leases lapse: the reaper takes the claims as "worker lost"
        with warnings.catch_warnings():  # redis-py deprecates setex, which Celery's backend still calls
            warnings.simplefilter("ignore", DeprecationWarning)
            app.backend.mark_as_revoked("revoked", "revoked")
            app.backend.mark_as_retry("retrying", RuntimeError("again"))
        summary = beat.reconcile(app)
        assert summary["settled"] == 1
        with engine.connect() as conn:
            outcomes = dict(conn.execute(sa.text("SELECT task_id, outcome FROM keyed_tasks")).all())
        assert outcomes == {"revoked": "revoked", "retrying": None}
        assert beat.reconcile(app)["settled"] == 0
    finally:
        engine.dispose()
        close_publisher(app)
