"""One way into an app's ledger and one dispatch of promotions (celery_keyed/access.py): every adapter (beat, the
CLI, the task, the package API, the Django app, the worker) builds its ledger with ``ledger_on`` and publishes the
promotions a change made with ``dispatch``, whose broker-error policy is the same everywhere: a warning, never a
failure, and the other promotions are still published."""

from __future__ import annotations

import ast
import base64
import contextlib
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_keyed.access import dispatch
from celery_keyed.ledger import Promotion

ROOT = Path(__file__).resolve().parents[2]


def _calls(name: str) -> set[str]:
    """Files of celery_keyed/ and django_app/ (the ledger package aside) that call ``name(...)``."""
    found = set()
    for folder in ("celery_keyed", "django_app"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if (ROOT / "celery_keyed" / "ledger") in path.parents or "migrations" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call):
                    func = node.func
                    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                    if called == name:
                        found.add(str(path.relative_to(ROOT)))
    return found


def test_one_builder_of_an_apps_ledger() -> None:
    assert _calls("Ledger") == {"celery_keyed/access.py"}


def test_one_dispatch_of_promotions() -> None:
    # messages.publish_promoted: the one loop and broker-error policy for promotions, used by access.dispatch
    # (beat, the CLI, the task, the package API, the Django app) and by the worker's handoff (the promotions it does
    # not run itself); publisher.py: the outbox relay (a first publish, no nonce).
    assert _calls("republish") == {"celery_keyed/messages.py", "celery_keyed/publisher.py"}
    assert _calls("publish_promoted") == {"celery_keyed/access.py", "celery_keyed/worker/handoff.py"}


class _Producer:
    def __init__(self, broken: set[str], published: list[str]) -> None:
        self.broken = broken
        self.published = published

    def publish(self, body: bytes, **kwargs: Any) -> None:
        task_id = kwargs["headers"]["id"]
        if task_id in self.broken:
            raise ConnectionError(f"broker down for {task_id}")
        self.published.append(task_id)


class _Pool:
    def __init__(self, producer: _Producer) -> None:
        self.producer = producer

    @contextlib.contextmanager
    def acquire(self, block: bool = True) -> Iterator[_Producer]:
        yield self.producer


class _App:
    """The broker side of a Celery app: what ``messages.republish`` uses."""

    def __init__(self, broken: set[str]) -> None:
        self.published: list[str] = []
        self.producer_pool = _Pool(_Producer(broken, self.published))


def _promotion(task_id: str, *, bound: bool = False) -> Promotion:
    message = {
        "body": base64.b64encode(b"[]").decode(),
        "exchange": "",
        "routing_key": "celery",
        "headers": {"id": task_id},
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "properties": {},
    }
    return Promotion(task_id, 0, None if bound else uuid.uuid4(), 1, "k:1", None, "celery", message)


def test_a_broker_error_is_a_warning_and_the_others_are_published(caplog: pytest.LogCaptureFixture) -> None:
    app = _App(broken={"b"})
    with caplog.at_level(logging.WARNING, logger="celery_keyed"):
        done = dispatch(app, [_promotion("a"), _promotion("b"), _promotion("c"), _promotion("d", bound=True)])
    assert app.published == ["a", "c"]  # d is bound to a worker already: not published
    assert done.published == 2
    assert done.failed == ["b"]
    assert isinstance(done.error, ConnectionError)
    assert "could not publish promoted task b" in caplog.text
