"""Debounce options (issue 14 item 2) without a broker or a database: the header a call sends (call, task, name), the
worker's reading of it (intake), and the checks (bad input is refused, never left waiting)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from celery_keyed import keyed_task
from celery_keyed.headers import HEADER_DEBOUNCE, HEADER_GROUP, HEADER_KEY, NOT_INHERITED
from celery_keyed.ledger import InvalidConfig, InvalidKey, NameConfig, parse_limits
from celery_keyed.worker.intake import debounce_of


@pytest.fixture
def app() -> Celery:
    return Celery("unit", set_as_current=False)


def test_the_task_option_and_the_call_option(app: Celery) -> None:
    @keyed_task(app=app, concurrency_key="doc:{doc}", debounce=5.0, debounce_max=30)
    def reindex(doc: int) -> None: ...

    computed = {HEADER_KEY: "doc:1"}
    assert reindex._debounce_header({}, computed) == [5.0, 30, "last"]
    assert reindex._debounce_header({"debounce_keep": "first"}, computed) == [5.0, 30, "first"]
    assert reindex._debounce_header({"debounce": 2.0}, computed) == [2.0, None, "last"]
    assert reindex._debounce_header({"debounce": None}, computed) is None  # not this call
    assert reindex._debounce_header({}, {}) is None  # an unkeyed call
    with pytest.raises(InvalidKey, match="no group_key"):
        reindex._debounce_header({}, {**computed, HEADER_GROUP: "g:1"})
    with pytest.raises(InvalidKey, match="debounce_max"):
        reindex._debounce_header({"debounce_max": 1.0}, computed)
    with pytest.raises(InvalidKey, match="debounce_keep"):
        reindex._debounce_header({"debounce_keep": "middle"}, computed)
    assert HEADER_DEBOUNCE in NOT_INHERITED  # a retry is never debounced again


def test_a_task_without_the_option_is_not_debounced(app: Celery) -> None:
    @keyed_task(app=app, concurrency_key="doc:{doc}")
    def plain(doc: int) -> None: ...

    assert plain._debounce_header({}, {HEADER_KEY: "doc:1"}) is None  # no ledger configured: no name options
    assert plain._debounce_header({"debounce": 1.5}, {HEADER_KEY: "doc:1"}) == [1.5, None, "last"]


def test_per_name_options_are_checked() -> None:
    config = parse_limits({"search": {"limit": 2, "debounce": 5.0, "debounce_max": 60, "debounce_keep": "first"}})
    assert config["search"].debounce == 5.0 and config["search"].debounce_keep == "first"
    for bad in ({"debounce": 0}, {"debounce_max": 10}, {"debounce": 5, "debounce_max": 1}, {"debounce": 5,
                                                                                           "debounce_keep": "x"}):
        with pytest.raises(InvalidConfig, match="search"):
            NameConfig("search", **bad)


def _request(headers: dict[str, Any], task: Any = None) -> Any:
    return SimpleNamespace(_request_dict=headers, task=task or SimpleNamespace(debounce=None))


def test_the_worker_reads_the_header() -> None:
    keyed = {HEADER_KEY: "doc:1"}
    assert debounce_of(_request({**keyed, HEADER_DEBOUNCE: [5, None, "last"]}), ["doc:1"], None, 0) == {
        "debounce": 5.0,
        "debounce_max": None,
        "debounce_keep": "last",
    }
    assert debounce_of(_request(keyed), ["doc:1"], None, 0) == {}  # the producer decided: not debounced
    assert debounce_of(_request({**keyed, HEADER_DEBOUNCE: [5, None, "last"]}), ["doc:1"], None, 1) == {}  # a retry
    task = SimpleNamespace(debounce=2.0, debounce_max=None, debounce_keep="first")
    assert debounce_of(_request({}, task), ["doc:1"], None, 0)["debounce_keep"] == "first"  # send_task: the task's
    for bad in ("5", [5], [0, None, "last"], [5, 1, "last"], [5, None, "x"], [True, None, "last"]):
        with pytest.raises(InvalidKey):
            debounce_of(_request({**keyed, HEADER_DEBOUNCE: bad}), ["doc:1"], None, 0)
    with pytest.raises(InvalidKey, match="group"):
        debounce_of(_request({**keyed, HEADER_DEBOUNCE: [5, None, "last"]}), ["doc:1"], "g:1", 0)


def test_apply_async_sends_the_header_per_task_call_and_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``apply_async`` with Celery's publish stubbed: the header per task, per call (or none), per name
    (read from the producer's own settings), never on a retry."""
    from celery import Task

    sent: list[Any] = []

    def publish(self: Any, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any) -> Any:
        sent.append(options["headers"].get(HEADER_DEBOUNCE))
        return task_id

    monkeypatch.setattr(Task, "apply_async", publish)
    app = Celery("unit", set_as_current=False)
    app.conf.keyed_database_url = "postgresql+psycopg://unit@127.0.0.1:1/none"  # never connected to
    app.conf.keyed_concurrency_limits = {"feed": {"limit": 1, "debounce": 3.0, "debounce_keep": "first"}}

    @keyed_task(app=app, concurrency_key="{key}")
    def by_name(key: str) -> None: ...

    @keyed_task(app=app, concurrency_key="doc:{doc}", debounce=5.0)
    def by_task(doc: int) -> None: ...

    by_name.apply_async(("feed:1",))  # the name's options
    by_name.apply_async(("other:1",))  # a name without them
    by_name.apply_async(("feed:1",), debounce=None)  # not this call
    by_task.apply_async((1,), debounce_max=20.0)
    by_task.apply_async((1,), retries=1)  # a retry: never debounced again
    assert sent == [[3.0, None, "first"], None, None, [5.0, 20.0, "last"], None]
