"""``concurrency_mode`` (readers and writers, issue 14 item 6) at publish: the header it sends, and the calls it
refuses (no broker, no database)."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_keyed import keyed_task
from celery_keyed.headers import HEADER_COST, HEADER_KEY, HEADER_MODE, INHERITED
from celery_keyed.ledger import EXCLUSIVE_COST, Arrival, InvalidKey


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
