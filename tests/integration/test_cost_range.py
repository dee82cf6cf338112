"""A cost (weight) out of range is bad input, refused at the producer and again at the worker's intake (D16): a
recorded rejection whose detail says the cost exceeds what a key can have, never a database error with a traceback,
and never an exclusive run (the exclusive cost is chosen by ``concurrency_mode``, no number picks it: D18)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.exceptions import TaskRevokedError

from celery_keyed import keyed_task
from celery_keyed.gate import GateService
from celery_keyed.headers import HEADER_COST, HEADER_KEY
from celery_keyed.ledger import COST_MAX, EXCLUSIVE_COST, InvalidKey, NameConfig
from celery_keyed.settings import read_settings


@pytest.fixture
def gate(database_url: str) -> Iterator[GateService]:
    app = Celery("cost-test", broker="memory://", set_as_current=False)
    app.conf.keyed_database_url = database_url
    consumer = SimpleNamespace(hostname="cost-test", timer=None, strategies={}, pool=None)
    service = GateService(app, consumer, read_settings(app.conf))
    yield service
    service.engine.dispose()


class _Backend:
    def __init__(self) -> None:
        self.failures: dict[str, BaseException] = {}

    def mark_as_failure(self, task_id: str, exc: BaseException, **_: Any) -> None:
        self.failures[task_id] = exc


class _Request(SimpleNamespace):
    """A request as Celery's worker state keeps it: in sets, by identity."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__


def _request(task_id: str, cost: object, backend: _Backend) -> _Request:
    """A request as a foreign producer's message makes it: a key and a ``keyed_cost`` header."""
    from kombu.message import Message

    headers = {"id": task_id, "task": "t", HEADER_KEY: "doc:1", HEADER_COST: cost}
    message = Message(
        body=b"[[], {}, {}]",
        content_type="application/json",
        content_encoding="utf-8",
        headers=headers,
        delivery_info={"exchange": "", "routing_key": "celery"},
    )
    return _Request(
        id=task_id,
        name="t",
        task=SimpleNamespace(name="t", backend=backend),
        args=[],
        kwargs={},
        _request_dict=dict(headers),
        _context=None,
        delivery_info={"routing_key": "celery"},
        _expires=None,
        _message=message,
        keyed_claim=None,
        keyed_started=False,
        keyed_arrival_key=None,
        acknowledge=lambda: None,
    )


@pytest.mark.parametrize("cost", [2**31, 2**40, EXCLUSIVE_COST])
def test_a_cost_out_of_range_is_a_recorded_rejection(
    gate: GateService, engine: sa.Engine, caplog: pytest.LogCaptureFixture, cost: int
) -> None:
    """2**31 and more reached Postgres (NumericValueOutOfRange, logged with a traceback); 2**30 ran the task as
    exclusive. Both are now rejected at intake, the detail saying why."""
    backend = _Backend()
    started: list[str] = []
    request = _request("c1", cost, backend)
    with caplog.at_level(logging.WARNING, logger="celery_keyed"), pytest.raises(TaskRevokedError):
        gate.execute(request, lambda: started.append("c1"))
    assert started == []
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT outcome, detail FROM keyed_tasks WHERE task_id = 'c1'")).one()
        assert conn.execute(sa.text("SELECT count(*) FROM keyed_claims")).scalar_one() == 0
    assert row.outcome == "rejected" and "exceeds the largest cost" in row.detail, row
    assert type(backend.failures["c1"]).__name__ == "KeyedRejected"
    assert "exceeds the largest cost" in str(backend.failures["c1"])
    assert "NumericValueOutOfRange" not in caplog.text and "Traceback" not in caplog.text


def test_the_largest_cost_is_admitted_where_a_key_can_have_it(gate: GateService, engine: sa.Engine) -> None:
    gate.ledger.configure({"doc": NameConfig("doc", limit=COST_MAX)})
    started: list[str] = []
    gate.execute(_request("big", COST_MAX, _Backend()), lambda: started.append("big"))
    assert started == ["big"]


@pytest.mark.parametrize("cost", [2**31, EXCLUSIVE_COST])
def test_the_producer_refuses_a_cost_out_of_range(cost: int) -> None:
    app = Celery("cost-producer", set_as_current=False)

    @keyed_task(app=app, concurrency_key="doc:{doc}")
    def work(doc: int) -> None: ...

    with pytest.raises(InvalidKey, match="exceeds the largest cost"):
        work.keyed_headers((1,), {}, {"concurrency_cost": cost})
    assert work.keyed_headers((1,), {}, {"concurrency_cost": COST_MAX})[HEADER_COST] == COST_MAX
