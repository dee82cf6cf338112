"""Newest-wins options (issue 14 item 1) without a broker or a database: the header a call sends (call, task, name),
the worker's reading of it (intake), the checks (bad input is refused, never left waiting), and what the gate does
with a cancel it passes on (the flag ``keyed_cancelled()`` reads, the outcome its release records)."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from celery_keyed import keyed_task
from celery_keyed.headers import HEADER_GROUP, HEADER_KEY, HEADER_ON_NEWER, INHERITED
from celery_keyed.ledger import InvalidConfig, InvalidKey, NameConfig, Outcome, Token, parse_limits
from celery_keyed.worker.intake import on_newer_of


@pytest.fixture
def app() -> Celery:
    return Celery("unit", set_as_current=False)


def test_the_task_option_and_the_call_option(app: Celery) -> None:
    @keyed_task(app=app, concurrency_key="doc:{doc}", on_newer="cancel_running")
    def render(doc: int) -> None: ...

    @keyed_task(app=app, concurrency_key="doc:{doc}")
    def plain(doc: int) -> None: ...

    assert render.keyed_headers((1,), {})[HEADER_ON_NEWER] == "cancel_running"
    assert HEADER_ON_NEWER not in render.keyed_headers((1,), {}, {"on_newer": None})  # not this call
    assert HEADER_ON_NEWER not in plain.keyed_headers((1,), {})  # the default: today's behaviour
    assert plain.keyed_headers((1,), {}, {"on_newer": "cancel_running"})[HEADER_ON_NEWER] == "cancel_running"
    with pytest.raises(InvalidKey, match="on_newer must be None or 'cancel_running'"):
        plain.keyed_headers((1,), {}, {"on_newer": "cancel"})
    assert HEADER_ON_NEWER in INHERITED  # a retry keeps it: its claim can be cancelled too


def test_per_name_option_is_checked() -> None:
    assert parse_limits({"doc": {"limit": 1, "on_newer": "cancel_running"}})["doc"].on_newer == "cancel_running"
    with pytest.raises(InvalidConfig, match="doc: on_newer must be"):
        NameConfig("doc", on_newer="newest")
    with pytest.raises(InvalidConfig, match="do not combine"):
        NameConfig("doc", on_newer="cancel_running", debounce=1.0)


def _request(headers: dict[str, Any], task: Any = None) -> Any:
    return SimpleNamespace(_request_dict=headers, task=task or SimpleNamespace(name="t", on_newer=None))


def test_the_worker_reads_the_header() -> None:
    keyed = {HEADER_KEY: "doc:1"}
    assert on_newer_of(_request({**keyed, HEADER_ON_NEWER: "cancel_running"}), ["doc:1"]) == "cancel_running"
    assert on_newer_of(_request(keyed), ["doc:1"]) is None  # the producer decided: not this call
    assert on_newer_of(_request({HEADER_GROUP: "g", HEADER_ON_NEWER: "cancel_running"}), []) is None  # no key
    task = SimpleNamespace(name="t", on_newer="cancel_running")
    assert on_newer_of(_request({}, task), ["doc:1"]) == "cancel_running"  # send_task: the task's own option
    for bad in ("yes", 1, ["cancel_running"]):
        with pytest.raises(InvalidKey):
            on_newer_of(_request({**keyed, HEADER_ON_NEWER: bad}), ["doc:1"])


def test_apply_async_sends_the_header_per_task_call_and_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery import Task

    sent: list[Any] = []

    def publish(self: Any, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any) -> Any:
        sent.append(options["headers"].get(HEADER_ON_NEWER))
        return task_id

    monkeypatch.setattr(Task, "apply_async", publish)
    app = Celery("unit", set_as_current=False)
    app.conf.keyed_database_url = "postgresql+psycopg://unit@127.0.0.1:1/none"  # never connected to
    app.conf.keyed_concurrency_limits = {"doc": {"limit": 1, "on_newer": "cancel_running"}}

    @keyed_task(app=app, concurrency_key="{key}")
    def by_name(key: str) -> None: ...

    by_name.apply_async(("doc:1",))  # the name's option
    by_name.apply_async(("other:1",))  # a name without it
    by_name.apply_async(("doc:1",), on_newer=None)  # not this call
    assert sent == ["cancel_running", None, None]
    with pytest.raises(InvalidKey, match="do not combine"):
        by_name.apply_async(("doc:1",), debounce=1.0)


def test_a_cancel_passed_on_raises_the_flag_and_the_release_records_superseded() -> None:
    """The gate's side on a pool that cannot terminate (threads): the flag ``keyed_cancelled()`` reads, and the
    outcome its release hands to the releaser whatever the body's outcome was."""
    from celery_keyed.worker.cancels import Cancels
    from celery_keyed.worker.finish import Finish
    from celery_keyed.worker.running import Running

    class Gate(Cancels, Finish):  # the running table's cancels and releases, on one table
        pass

    handed: list[tuple[Any, ...]] = []
    gate: Any = Gate.__new__(Gate)
    gate.lock = threading.Lock()
    gate.pid = os.getpid()
    gate.running = {}
    gate.releasing = 0
    gate.can_terminate = lambda: False
    gate.handoff = SimpleNamespace(note_run=lambda seconds: None)
    gate.fit_prefetch = lambda: None
    gate.releaser = SimpleNamespace(
        hand_over=lambda token, fence, outcome, **kw: handed.append((token, outcome, kw["detail"])),
        is_contended=lambda key: False,
    )
    request = SimpleNamespace(
        name="t", keyed_claim=(Token("a", 0), 7), keyed_arrival_key="doc:1", keyed_cancelled=None,
        task=SimpleNamespace(uncertain_hold=None),
    )
    gate.running[Token("a", 0)] = entry = Running(request, Token("a", 0), 7)
    assert not gate.cancelled("a", 0)
    gate.cancel_running([(entry, "superseded by b (newest wins)")])
    assert gate.cancelled("a", 0) and request.keyed_cancelled == "superseded by b (newest wins)"
    gate.release(request, Outcome.COMPLETED)  # the body returned anyway: the cancel had reached it
    assert handed == [(Token("a", 0), Outcome.SUPERSEDED, "superseded by b (newest wins)")]
    assert not gate.cancelled("a", 0)  # no longer running here
