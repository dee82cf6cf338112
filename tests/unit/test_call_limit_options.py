"""Limits computed from the call (``concurrency_limit``) without a broker or a database: the header a call sends
(integer, callable, template; per call only with ``per_call_keys``), what a retry keeps, the worker's reading of it
(the declaration wins over a header unless the task accepts per-call keys), and the checks (bad input is refused at
the call or at receipt, never left waiting)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from celery_keyed import keyed_task
from celery_keyed.headers import HEADER_KEY, HEADER_LIMIT, INHERITED
from celery_keyed.ledger import InvalidKey
from celery_keyed.worker.intake import arrival_for

PLANS = {"gold": 10, "tin": 2}


@pytest.fixture
def app() -> Celery:
    return Celery("unit", set_as_current=False)


def test_the_call_computes_its_keys_limit(app: Celery) -> None:
    @keyed_task(app=app, concurrency_key="tenant:{tenant}", concurrency_limit=lambda tenant, **_: PLANS[tenant])
    def sync(tenant: str, limit: int = 3) -> None: ...

    assert sync.keyed_headers(("gold",), {})[HEADER_LIMIT] == 10
    assert sync.keyed_headers(("tin",), {})[HEADER_LIMIT] == 2
    assert HEADER_LIMIT in INHERITED  # a retry keeps it (the worker computes it again anyway)

    @keyed_task(app=app, concurrency_key="tenant:{tenant}", concurrency_limit="{limit}")
    def templated(tenant: str, limit: int = 3) -> None: ...

    assert templated.keyed_headers(("gold",), {})[HEADER_LIMIT] == 3
    assert templated.keyed_headers(("gold", 0), {})[HEADER_LIMIT] == 0  # 0: the key's attempts wait

    @keyed_task(app=app, concurrency_key="tenant:{tenant}")
    def undeclared(tenant: str) -> None: ...

    assert HEADER_LIMIT not in undeclared.keyed_headers(("gold",), {})  # the name's configured limit applies

    @keyed_task(app=app, group_key="tenant:{tenant}", concurrency_limit=5)
    def grouped(tenant: str) -> None: ...

    assert HEADER_LIMIT not in grouped.keyed_headers(("gold",), {})  # no concurrency key: nothing to limit


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3", lambda **_: -3, 2**31, "{missing}", "{a}-{b}"])
def test_bad_limits_are_refused_at_the_call(app: Celery, bad: Any) -> None:
    @keyed_task(app=app, concurrency_key="tenant:{tenant}", concurrency_limit=bad)
    def sync(tenant: str, a: int = 1, b: int = 2) -> None: ...

    with pytest.raises(InvalidKey, match="concurrency_limit"):
        sync.keyed_headers(("gold",), {})


def test_a_per_call_limit_needs_per_call_keys(app: Celery) -> None:
    @keyed_task(app=app, concurrency_key="tenant:{tenant}", concurrency_limit=2)
    def fixed(tenant: str) -> None: ...

    with pytest.raises(InvalidKey, match="per_call_keys"):
        fixed.apply_async(("gold",), concurrency_limit=50)

    @keyed_task(app=app, concurrency_key="tenant:{tenant}", concurrency_limit=2, per_call_keys=True)
    def flexible(tenant: str) -> None: ...

    assert flexible.keyed_headers(("gold",), {}, {"concurrency_limit": 7})[HEADER_LIMIT] == 7


def _request(headers: dict[str, Any], task: Any, args: tuple[Any, ...] = ()) -> Any:
    return SimpleNamespace(
        _request_dict=headers, task=task, args=args, kwargs={}, id="t1", name=task.name, delivery_info={},
        _expires=None, _message=SimpleNamespace(headers=headers, properties={}, body=b"", content_type="",
                                                content_encoding="", delivery_info={}),
    )


def test_the_worker_follows_the_declaration_unless_the_task_accepts_per_call_keys(
    app: Celery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("celery_keyed.worker.intake.record_message", lambda message, task_name: {})

    @keyed_task(app=app, concurrency_key="tenant:{tenant}", concurrency_limit=lambda tenant, **_: PLANS[tenant])
    def declared(tenant: str) -> None: ...

    task = declared._get_current_object()
    arrival = arrival_for(_request({}, task, ("tin",)))  # send_task without headers: computed from the arguments
    assert arrival is not None and arrival.call_limit == 2
    forged = arrival_for(_request({HEADER_KEY: "tenant:tin", HEADER_LIMIT: 50}, task, ("tin",)))
    assert forged is not None and forged.call_limit == 2  # a header never raises a declared limit
    assert "the declared concurrency_limit applies" in caplog.text
    with pytest.raises(InvalidKey, match="concurrency_limit"):
        arrival_for(_request({HEADER_KEY: "tenant:tin", HEADER_LIMIT: "many"}, task, ("tin",)))  # checked always

    @keyed_task(app=app, concurrency_key="tenant:{tenant}", concurrency_limit=2, per_call_keys=True)
    def flexible(tenant: str) -> None: ...

    task = flexible._get_current_object()
    sent = arrival_for(_request({HEADER_KEY: "tenant:tin", HEADER_LIMIT: 7}, task, ("tin",)))
    assert sent is not None and sent.call_limit == 7
    plain = arrival_for(_request({HEADER_KEY: "tenant:tin"}, task, ("tin",)))
    assert plain is not None and plain.call_limit == 2  # no header: the declaration's
