"""A key callable that raises a ``BaseException`` which is not an ``Exception``: the message's fault (``InvalidKey``,
a recorded rejection) unless this worker is shutting down, when it goes on up (the worker's real stop)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.worker import state

from celery_keyed import keyed_task
from celery_keyed.ledger import InvalidKey
from celery_keyed.worker.intake import arrival_for


class Escape(BaseException):
    pass


@pytest.fixture
def task(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setattr("celery_keyed.worker.intake.record_message", lambda message, task_name: {})
    app = Celery("unit", set_as_current=False)
    raised: dict[str, BaseException] = {}

    def key(n: int) -> str:
        raise raised["exc"]

    @keyed_task(app=app, concurrency_key=key)
    def t(n: int) -> None: ...

    real = t._get_current_object()
    real.raised = raised
    yield real
    app.close()


def _request(task: Any) -> Any:
    message = SimpleNamespace(
        headers={}, properties={}, body=b"", content_type="", content_encoding="", delivery_info={}
    )
    return SimpleNamespace(_request_dict={}, task=task, args=(1,), kwargs={}, id="t1", name=task.name,
                           delivery_info={}, _expires=None, _message=message)  # fmt: skip


@pytest.fixture
def worker_sigint() -> Iterator[None]:
    """SIGINT handled as a Celery worker handles it (its own handler sets a shutdown flag; it raises nothing)."""
    previous = signal.signal(signal.SIGINT, lambda *_: None)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt(), Escape("mine"), GeneratorExit()])
def test_a_base_exception_from_a_key_is_invalid_input(task: Any, exc: BaseException, worker_sigint: None) -> None:
    task.raised["exc"] = exc
    with pytest.raises(InvalidKey, match=type(exc).__name__):
        arrival_for(_request(task))


def test_outside_a_worker_a_keyboard_interrupt_is_ctrl_c(task: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signal, "getsignal", lambda signum: signal.default_int_handler)
    task.raised["exc"] = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        arrival_for(_request(task))


@pytest.mark.parametrize("flag", ["should_stop", "should_terminate"])
def test_while_the_worker_shuts_down_it_goes_on_up(
    task: Any, flag: str, monkeypatch: pytest.MonkeyPatch, worker_sigint: None
) -> None:
    monkeypatch.setattr(state, flag, 0)  # Celery's EX_OK: set, though falsy
    task.raised["exc"] = SystemExit(0)
    with pytest.raises(SystemExit):
        arrival_for(_request(task))
