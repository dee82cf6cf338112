"""Weighted fair sharing options (issue 14 item 5) without a broker or a database: the header a call sends (task
option, call option, callable, template), what a retry keeps, the worker's reading of it (intake), the settings
table ``keyed_fair_weights``, and the checks (bad input is refused, never left waiting)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from celery_keyed import keyed_task
from celery_keyed.headers import HEADER_FAIR, HEADER_FAIR_WEIGHT, HEADER_KEY, INHERITED
from celery_keyed.ledger import InvalidConfig, InvalidKey
from celery_keyed.settings import read_settings
from celery_keyed.worker.intake import arrival_for

URL = "postgresql://user@localhost/db"


@pytest.fixture
def app() -> Celery:
    return Celery("unit", set_as_current=False)


def test_the_weight_goes_with_the_fair_key(app: Celery) -> None:
    @keyed_task(app=app, concurrency_key="crm:{region}", fair_key="tenant:{tenant}", fair_weight=3)
    def sync(region: str, tenant: str, weight: float = 1.0) -> None: ...

    headers = sync.keyed_headers(("eu", "big"), {})
    assert headers[HEADER_FAIR] == "tenant:big" and headers[HEADER_FAIR_WEIGHT] == 3.0
    assert sync.keyed_headers(("eu", "big"), {}, {"fair_weight": 0.5})[HEADER_FAIR_WEIGHT] == 0.5  # per call
    assert HEADER_FAIR_WEIGHT not in sync.keyed_headers(("eu", "big"), {}, {"fair_weight": None})
    assert sync.keyed_headers(("eu", "big", 7), {}, {"fair_weight": "{weight}"})[HEADER_FAIR_WEIGHT] == 7.0
    plans = {"big": 5, "small": 1}
    by_plan = sync.keyed_headers(("eu", "big"), {}, {"fair_weight": lambda tenant, **_: plans[tenant]})
    assert by_plan[HEADER_FAIR_WEIGHT] == 5.0
    assert HEADER_FAIR_WEIGHT in INHERITED  # a retry keeps its weight


def test_no_fair_key_no_weight(app: Celery) -> None:
    @keyed_task(app=app, concurrency_key="crm:{region}", fair_weight=3)
    def sync(region: str) -> None: ...

    assert HEADER_FAIR_WEIGHT not in sync.keyed_headers(("eu",), {})


@pytest.mark.parametrize("bad", [0, -1, True, "3", float("inf"), float("nan"), 10**9, "{missing}"])
def test_bad_weights_are_refused_at_the_call(app: Celery, bad: Any) -> None:
    @keyed_task(app=app, concurrency_key="crm:{region}", fair_key="tenant:{tenant}")
    def sync(region: str, tenant: str) -> None: ...

    with pytest.raises(InvalidKey, match="fair_weight"):
        sync.keyed_headers(("eu", "big"), {}, {"fair_weight": bad})


def _request(headers: dict[str, Any], task: Any, args: tuple[Any, ...] = ()) -> Any:
    return SimpleNamespace(
        _request_dict=headers, task=task, args=args, kwargs={}, id="t1", name=task.name, delivery_info={},
        _expires=None, _message=SimpleNamespace(headers=headers, properties={}, body=b"", content_type="",
                                                content_encoding="", delivery_info={}),
    )


def test_the_worker_reads_the_header_or_computes_it(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    @keyed_task(app=app, concurrency_key="crm:{region}", fair_key="tenant:{tenant}", fair_weight=2, per_call_keys=True)
    def sync(region: str, tenant: str) -> None: ...

    monkeypatch.setattr("celery_keyed.worker.intake.record_message", lambda message, task_name: {})
    sync = sync._get_current_object()  # the task itself, as the worker's request has it (not the app's proxy)
    keyed = {HEADER_KEY: "crm:eu", HEADER_FAIR: "tenant:big"}
    arrival = arrival_for(_request({**keyed, HEADER_FAIR_WEIGHT: 4}, sync))
    assert arrival is not None and arrival.fair_weight == 4.0
    arrival = arrival_for(_request(keyed, sync))
    assert arrival is not None and arrival.fair_weight is None  # the producer decided: no weight of its own
    arrival = arrival_for(_request({}, sync, ("eu", "big")))  # send_task: computed from the arguments
    assert arrival is not None and arrival.fair_key == "tenant:big" and arrival.fair_weight == 2.0
    for bad in (0, -2, "x", [1], True):
        with pytest.raises(InvalidKey):
            arrival_for(_request({**keyed, HEADER_FAIR_WEIGHT: bad}, sync))


def test_the_settings_table_joins_the_fair_names() -> None:
    settings = read_settings({
        "keyed_database_url": URL,
        "keyed_concurrency_limits": {"crm": {"limit": 4, "fair": True}},
        "keyed_fair_weights": {"crm": {"tenant:big": 3, "tenant": 1.5}},
    })
    assert settings.limits["crm"].fair_weights == {"tenant:big": 3.0, "tenant": 1.5}
    inline = read_settings({
        "keyed_database_url": URL,
        "keyed_concurrency_limits": {"crm": {"limit": 4, "fair": True, "fair_weights": {"tenant:big": 2}}},
    })
    assert inline.limits["crm"].fair_weights == {"tenant:big": 2.0}


@pytest.mark.parametrize(
    ("limits", "weights", "message"),
    [
        ({"crm": 4}, {"crm": {"t": 2}}, "not configure as fair"),
        ({}, {"crm": {"t": 2}}, "not configure as fair"),
        ({"crm": {"limit": 4, "fair": True}}, {"crm": {"t": 0}}, "fair weight"),
        ({"crm": {"limit": 4, "fair": True}}, {"crm": {"": 2}}, "prefix"),
        ({"crm": {"limit": 4, "fair": True}}, {"crm": [("t", 2)]}, "dict"),
        ({"crm": {"limit": 4, "fair": True}}, ["crm"], "dict by name"),
    ],
)
def test_bad_weight_tables_are_refused(limits: Any, weights: Any, message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        read_settings({"keyed_database_url": URL, "keyed_concurrency_limits": limits, "keyed_fair_weights": weights})
