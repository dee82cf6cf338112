"""Which stored results the reconciler books for a task lost with a failover (celery_keyed.lost_books): only a final
result of a keyed call, stored in the failover's window, with the name extended results carry."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery

from celery_keyed import keyed_task
from celery_keyed.exceptions import KeyedExpired
from celery_keyed.ledger import LostArrival
from celery_keyed.lost_books import _UNEXTENDED, _lost_arrival

AT = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
SINCE, UNTIL = AT - timedelta(minutes=10), AT + timedelta(seconds=10)


def _app() -> Any:
    app = Celery("lost-books-unit", set_as_current=False)

    @keyed_task(app=app, name="u.keyed", concurrency_key=lambda account: None if account is None else f"acct:{account}")
    def keyed(account: int | None) -> None: ...

    @keyed_task(app=app, name="u.grouped", group_key="order:{order}")
    def grouped(order: int) -> None: ...

    @app.task(name="u.plain")
    def plain(account: int) -> None: ...

    return app


APP = _app()  # once: its tasks' names are registered once


def _meta(
    name: str | None, *args: Any, status: str = "SUCCESS", done: datetime = AT, retries: int = 0
) -> dict[str, Any]:
    meta: dict[str, Any] = {"task_id": "t1", "status": status, "date_done": done.isoformat(), "args": list(args),
                            "kwargs": {}, "retries": retries}
    if name is not None:
        meta["name"] = name
    return meta


def test_a_final_result_of_a_keyed_call_in_the_window_is_booked_with_its_key_and_attempt() -> None:
    app = APP
    assert _lost_arrival(app, _meta("u.keyed", 3), since=SINCE, until=UNTIL) == LostArrival(
        "t1", 0, "u.keyed", "acct:3", "completed"
    )
    failed = _lost_arrival(app, _meta("u.keyed", 3, status="FAILURE", retries=2), since=SINCE, until=UNTIL)
    assert failed == LostArrival("t1", 2, "u.keyed", "acct:3", "failed")
    rejected = _meta("u.keyed", 3, status="FAILURE")
    rejected["result"] = {"exc_type": "KeyedRejected", "exc_message": ["over max_waiting"], "exc_module": "x"}
    assert _lost_arrival(app, rejected, since=SINCE, until=UNTIL).outcome == "rejected"  # type: ignore[attr-defined]
    rejected["result"] = KeyedExpired("not started before its deadline")  # a pickled result: the exception itself
    assert _lost_arrival(app, rejected, since=SINCE, until=UNTIL).outcome == "expired"  # type: ignore[attr-defined]
    naive = _meta("u.keyed", 3)
    naive["date_done"] = AT.replace(tzinfo=None).isoformat()  # a naive date is UTC
    assert isinstance(_lost_arrival(app, naive, since=SINCE, until=UNTIL), LostArrival)


def test_anything_else_is_left_alone() -> None:
    app = APP
    for meta in (
        _meta("u.keyed", 3, status="RETRY"),  # not final: its retry comes
        _meta("u.keyed", 3, status="STARTED"),
        _meta("u.keyed", 3, status="REVOKED"),
        _meta("u.keyed", 3, done=SINCE - timedelta(seconds=1)),  # before the window
        _meta("u.keyed", 3, done=UNTIL + timedelta(seconds=1)),  # after the hold: booked by its own worker
        _meta("u.plain", 3),  # not keyed
        _meta("u.keyed", None),  # a call without a key: never in the books
        _meta("u.grouped", 3),  # a group member: its group settles it
        _meta("other.app", 3),  # not a task of this app
        "not a dict",
    ):
        assert _lost_arrival(app, meta, since=SINCE, until=UNTIL) is None, meta
    assert _lost_arrival(app, _meta(None, 3), since=SINCE, until=UNTIL) is _UNEXTENDED
