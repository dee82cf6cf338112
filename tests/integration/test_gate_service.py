"""The gate service's background duties on real Postgres, driven directly (no worker): releasing claims of
requests that were admitted but never started (D6), and noticing a reclaimed slot (D7)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_keyed.gate import GateService, _Running
from celery_keyed.ledger import Arrival, Token
from celery_keyed.settings import read_settings


@pytest.fixture
def gate(database_url: str):
    app = Celery("gate-test", broker="memory://", set_as_current=False)
    app.conf.keyed_database_url = database_url
    app.conf.keyed_lease = 2.0
    consumer = SimpleNamespace(hostname="gate-test", timer=None, strategies={}, pool=None)
    service = GateService(app, consumer, read_settings(app.conf))
    yield service
    service.engine.dispose()


def _track(gate: GateService, task_id: str, key: str, *, started: bool, age: float) -> SimpleNamespace:
    admission = gate.ledger.admit(Arrival(task_id, key=key))
    token = Token(task_id, 0)
    request = SimpleNamespace(
        name="t", keyed_started=started, keyed_claim=(token, admission.fence), keyed_arrival_key=key
    )
    gate._running[token] = _Running(request, token, admission.fence, claimed_at=time.monotonic() - age)
    return request


def test_a_claim_admitted_but_never_started_is_released(gate: GateService, engine: sa.Engine) -> None:
    dropped = _track(gate, "dropped", "k:1", started=False, age=5.0)  # the consumer reset forgot it
    young = _track(gate, "young", "k:2", started=False, age=0.0)  # just admitted: may still start
    running = _track(gate, "running", "k:3", started=True, age=5.0)
    gate.heartbeat_once()
    with engine.connect() as conn:
        held = set(conn.execute(sa.text("SELECT task_id FROM keyed_claims")).scalars())
        open_tasks = set(conn.execute(sa.text("SELECT task_id FROM keyed_tasks WHERE outcome IS NULL")).scalars())
    assert held == {"young", "running"}
    assert dropped.keyed_claim is None and young.keyed_claim is not None and running.keyed_claim is not None
    assert "dropped" in open_tasks  # worker lost, not finished: its redelivery will be admitted again


def test_a_reclaimed_slot_is_noticed_and_no_longer_tracked(gate: GateService, engine: sa.Engine) -> None:
    request = _track(gate, "lost", "k:1", started=True, age=0.0)
    with engine.begin() as conn:  # the reaper took it (the lease lapsed while this worker was stalled)
        conn.execute(sa.text("DELETE FROM keyed_claims WHERE task_id = 'lost'"))
    gate.heartbeat_once()
    assert request.keyed_claim is None
    assert Token("lost", 0) not in gate._running
