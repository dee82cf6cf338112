"""Which sends are checked at send (issue 14 item 3), without a broker or a database: the publisher's check is
replaced by a recorder, Celery's publish by a stub."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_keyed import keyed_task
from celery_keyed import publisher as publisher_module
from celery_keyed.ledger import InvalidKey, NameConfig


@pytest.fixture
def app() -> Celery:
    app = Celery("unit", set_as_current=False)
    app.conf.keyed_database_url = "postgresql+psycopg://unit@127.0.0.1:1/none"
    return app


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str | None]]:
    seen: list[tuple[str, str, str | None]] = []  # checks, and ("forget", task_id, None) for a place given back

    def admit_at_send(app: Any, task_id: str, key: str, *, dedupe_key: str | None = None, connection: Any = None):
        seen.append((task_id, key, dedupe_key))
        return True

    monkeypatch.setattr(publisher_module, "admit_at_send", admit_at_send)
    monkeypatch.setattr(publisher_module, "forget_send", lambda app, task_id: seen.append(("forget", task_id, None)))
    return seen


def _no_publish(monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> None:
    from celery import Task

    def apply_async(self: Any, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any):
        if fail:
            raise ConnectionError("broker down")
        return task_id

    monkeypatch.setattr(Task, "apply_async", apply_async)


def test_task_option_checks_every_send_with_its_first_key(app, checks, monkeypatch) -> None:
    _no_publish(monkeypatch)

    @keyed_task(app=app, concurrency_key=["feed:{n}", "global"], admit_at_send=True)
    def t(n: int) -> None: ...

    t.apply_async((1,), task_id="a")
    t.apply_async((2,), task_id="b", keyed_admit_at_send=False)  # per call: off
    assert checks == [("a", "feed:1", None)]


def test_dedupe_key_implies_the_check_and_needs_a_key(app, checks, monkeypatch) -> None:
    _no_publish(monkeypatch)

    @keyed_task(app=app, concurrency_key="feed:{n}", dedupe_key="order:{order}", per_call_keys=True)
    def t(n: int | None, order: int) -> None: ...

    t.apply_async((1, 7), task_id="a")
    t.apply_async((1, 8), task_id="b", dedupe_key=None)  # per call: no dedupe key, no check
    assert checks == [("a", "feed:1", "order:7")]
    with pytest.raises(InvalidKey, match="needs a concurrency key"):
        t.apply_async((1, 9), concurrency_key=None)


def test_per_call_and_per_name_options(app, checks, monkeypatch) -> None:
    _no_publish(monkeypatch)
    app.conf.keyed_concurrency_limits = {"feed": {"limit": 2, "max_waiting": 5, "admit_at_send": True}}

    @keyed_task(app=app, concurrency_key="{key}")
    def t(key: str) -> None: ...

    t.apply_async(("plain:1",), task_id="a")  # name without the option: not checked
    t.apply_async(("plain:1",), task_id="b", keyed_admit_at_send=True)
    t.apply_async(("feed:1",), task_id="c")  # the name asks for it
    t.apply_async((None,), task_id="d", keyed_admit_at_send=True)  # unkeyed call: nothing to check
    assert checks == [("b", "plain:1", None), ("c", "feed:1", None)]
    publisher_module.close_publisher(app)


def test_a_failed_publish_gives_the_place_back(app, checks, monkeypatch) -> None:
    _no_publish(monkeypatch, fail=True)

    @keyed_task(app=app, concurrency_key="feed:1", admit_at_send=True)
    def t() -> None: ...

    with pytest.raises(ConnectionError):
        t.apply_async(task_id="a")
    assert checks == [("a", "feed:1", None), ("forget", "a", None)]


def test_admit_at_send_name_option_is_a_bool() -> None:
    assert NameConfig.from_setting("feed", {"limit": 1, "admit_at_send": True}).admit_at_send
    with pytest.raises(Exception, match="admit_at_send must be True or False"):
        NameConfig.from_setting("feed", {"limit": 1, "admit_at_send": "yes"})
