"""Which key ``self.keyed_pause`` / ``self.keyed_set_limit`` throttle (issue 14 item 4): the running call's own key —
from its header, else computed from its arguments (``send_task``) — or, for a call with several keys, the one named by
``key=``; never a key the call does not hold."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_keyed import keyed_task
from celery_keyed.ledger import InvalidKey


def tasks() -> tuple[Any, Any, Any]:
    app = Celery("throttle-unit", set_as_current=False)

    @keyed_task(app=app, bind=True, concurrency_key="acct:{acct}", per_call_keys=True)
    def one(self: Any, acct: int) -> None: ...

    @keyed_task(app=app, bind=True, concurrency_key=["tenant:{tenant}", "stripe"])
    def several(self: Any, tenant: str) -> None: ...

    @keyed_task(app=app, bind=True)
    def unkeyed(self: Any) -> None: ...

    return one, several, unkeyed


def own_key(task: Any, key: str | None = None, **request: Any) -> str:
    task.push_request(id="t-1", **request)
    try:
        return task._keyed_own_key(key)
    finally:
        task.pop_request()


def test_the_calls_own_key_from_its_header_else_from_its_arguments() -> None:
    one, _, _ = tasks()
    assert own_key(one, args=(7,), kwargs={}) == "acct:7"  # send_task: no header, computed like the worker does
    assert own_key(one, args=(7,), kwargs={}, keyed_key="acct:9") == "acct:9"  # the header wins
    assert own_key(one, "acct:9", args=(7,), kwargs={}, keyed_key="acct:9") == "acct:9"
    one.push_request(id="t-1", args=(7,), kwargs={})
    try:
        assert one._keyed_author() == f"task {one.name}[t-1]"
    finally:
        one.pop_request()


def test_several_keys_need_key_and_a_foreign_key_is_refused() -> None:
    _, several, unkeyed = tasks()
    header = {"args": ("a",), "kwargs": {}, "keyed_key": ["tenant:a", "stripe"]}
    with pytest.raises(InvalidKey, match="several keys"):
        own_key(several, **header)
    assert own_key(several, "stripe", **header) == "stripe"
    assert own_key(several, ("tenant", "a"), **header) == "tenant:a"  # type: ignore[arg-type]
    with pytest.raises(InvalidKey, match="not a concurrency key of this call"):
        own_key(several, "stripe:other", **header)
    with pytest.raises(InvalidKey, match="no concurrency key"):
        own_key(unkeyed, args=(), kwargs={})
