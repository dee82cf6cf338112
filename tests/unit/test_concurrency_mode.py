"""``concurrency_mode`` (readers and writers, issue 14 item 6) at publish: the header it sends, and the calls it
refuses (no broker, no database)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from celery import Celery

from celery_keyed import keyed_task
from celery_keyed.headers import HEADER_COST, HEADER_KEY, HEADER_MODE, INHERITED
from celery_keyed.ledger import EXCLUSIVE_COST, Arrival, InvalidKey
from celery_keyed.worker.intake import arrival_for


@pytest.fixture
def app() -> Celery:
    return Celery("unit", set_as_current=False)


def test_shared_is_the_default_and_sends_nothing_new(app: Celery) -> None:
    @keyed_task(app=app, concurrency_key="doc:{doc}")
    def read(doc: int) -> None: ...

    assert read.keyed_headers((1,), {}) == {HEADER_KEY: "doc:1"}
    assert read.keyed_headers((1,), {}, {"concurrency_mode": "exclusive"}) == {
        HEADER_KEY: "doc:1",
        HEADER_MODE: "exclusive",
    }


def test_an_exclusive_class_sends_its_mode_and_a_call_may_share(app: Celery) -> None:
    @keyed_task(app=app, concurrency_key="doc:{doc}", concurrency_mode="exclusive")
    def write(doc: int) -> None: ...

    assert write.keyed_headers((1,), {}) == {HEADER_KEY: "doc:1", HEADER_MODE: "exclusive"}
    # The worker falls back to the class's mode without the header: a shared call says so.
    assert write.keyed_headers((1,), {}, {"concurrency_mode": "shared"}) == {HEADER_KEY: "doc:1", HEADER_MODE: "shared"}
    assert write.keyed_headers((1,), {}, {"concurrency_key": None}) == {}  # unkeyed: no mode
    assert HEADER_MODE in INHERITED  # a retry keeps its mode


def test_calls_an_exclusive_task_cannot_make(app: Celery) -> None:
    @keyed_task(app=app, concurrency_key="doc:{doc}")
    def write(doc: int) -> None: ...

    with pytest.raises(InvalidKey, match="'shared' or 'exclusive'"):
        write.keyed_headers((1,), {}, {"concurrency_mode": "writer"})
    with pytest.raises(InvalidKey, match="no concurrency_cost"):
        write.keyed_headers((1,), {}, {"concurrency_mode": "exclusive", "concurrency_cost": 2})
    with pytest.raises(InvalidKey, match="exactly one concurrency key"):
        write.keyed_headers((1,), {}, {"concurrency_mode": "exclusive", "concurrency_key": ["doc:1", "doc:2"]})
    assert HEADER_COST not in write.keyed_headers((1,), {}, {"concurrency_mode": "exclusive"})


def test_an_exclusive_arrival_is_its_whole_key() -> None:
    assert Arrival("t", key="doc:1", cost=EXCLUSIVE_COST).exclusive
    assert not Arrival("t", key="doc:1", cost=3).exclusive


def _received(headers: dict, task: object) -> SimpleNamespace:
    from kombu.message import Message

    headers = {"id": "t1", "task": "t", **headers}
    message = Message(
        body=b"[[], {}, {}]",
        content_type="application/json",
        content_encoding="utf-8",
        headers=headers,
        delivery_info={"exchange": "", "routing_key": "celery"},
    )
    return SimpleNamespace(
        id="t1",
        name="t",
        task=task,
        args=[],
        kwargs={},
        _request_dict=dict(headers),
        delivery_info={"routing_key": "celery"},
        _expires=None,
        _message=message,
    )


def test_the_worker_reads_the_mode_from_the_header_else_the_task() -> None:
    # tasks that take per-call keys: the header decides (without them the declaration does, tests/unit/test_trust.py)
    shared = SimpleNamespace(per_call_keys=True)
    exclusive = SimpleNamespace(concurrency_mode="exclusive", per_call_keys=True)
    assert arrival_for(_received({HEADER_KEY: "doc:1"}, shared)).cost == 1
    assert arrival_for(_received({HEADER_KEY: "doc:1", HEADER_MODE: "exclusive"}, shared)).cost == EXCLUSIVE_COST
    assert arrival_for(_received({HEADER_KEY: "doc:1"}, exclusive)).exclusive
    assert not arrival_for(_received({HEADER_KEY: "doc:1", HEADER_MODE: "shared"}, exclusive)).exclusive


TRUSTED = SimpleNamespace(per_call_keys=True)


def test_a_foreign_producers_bad_mode_is_bad_input() -> None:
    """InvalidKey at the gate's edge: a recorded rejection with a KeyedRejected result (D16)."""
    with pytest.raises(InvalidKey, match="'shared' or 'exclusive'"):
        arrival_for(_received({HEADER_KEY: "doc:1", HEADER_MODE: 1}, TRUSTED))
    with pytest.raises(InvalidKey, match="exactly one concurrency key"):
        arrival_for(_received({HEADER_KEY: ["doc:1", "doc:2"], HEADER_MODE: "exclusive"}, TRUSTED))
    with pytest.raises(InvalidKey, match="no concurrency_cost"):
        arrival_for(_received({HEADER_KEY: "doc:1", HEADER_MODE: "exclusive", HEADER_COST: 2}, TRUSTED))
