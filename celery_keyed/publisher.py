"""The producer side's access to the ledger (group registration at publish, D10; refusal at send, issue 14
item 3): one engine per process and app, created on first use (a forked pool child creates its own)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from celery_keyed.engine import create_ledger_engine
from celery_keyed.exceptions import KeyedRejected
from celery_keyed.ledger import Ledger, SendVerdict, sent_admit
from celery_keyed.settings import KeyedSettings, read_settings

_lock = threading.Lock()


@dataclass
class Publisher:
    settings: KeyedSettings
    engine: sa.Engine
    pid: int
    _ledger: Ledger | None = field(default=None, repr=False)

    @property
    def ledger(self) -> Ledger:
        """A ledger on this publisher's engine (producer calls hold no claim: no holder of their own matters)."""
        ledger = self._ledger
        if ledger is None:
            ledger = Ledger(self.engine, lease=self.settings.lease, dispatch=self.settings.dispatch_timeout)
            self._ledger = ledger
        return ledger


class SendRefused(KeyedRejected):
    """A send refused by the ledger before anything was published (``keyed_admit_at_send``): ``reason`` is
    ``"room_full"`` (the key's waiting room, counting the sends not arrived yet, is at ``max_waiting``) or
    ``"duplicate"`` (``holder_task_id`` is the live task with the same dedupe key). Nothing was booked."""

    def __init__(self, task_id: str, key: str, verdict: SendVerdict) -> None:
        super().__init__(f"{task_id} refused at send under {key}: {verdict.detail}")
        self.task_id = task_id
        self.key = key
        self.reason = verdict.reason
        self.detail = verdict.detail
        self.holder_task_id = verdict.holder_task_id


def admit_at_send(
    app: Any, task_id: str, key: str, *, dedupe_key: str | None = None, connection: sa.Connection | None = None
) -> bool:
    """Ask the ledger, in one round trip, whether ``task_id`` may be published under ``key`` (its first
    concurrency key); raise :class:`SendRefused` (a ``KeyedRejected``) when not. ``connection``: decide in the
    caller's open transaction (the reservation commits or rolls back with it). True when this call reserved a new
    place (the caller gives it back with ``forget_send`` if the publish then fails); False for a task id that had
    one (a retry). An unreachable ledger raises its error: the caller asked for a check, nothing is published."""
    publisher = publisher_for(app, required=True)
    assert publisher is not None  # required=True raises instead
    timeout = publisher.settings.send_arrival_timeout
    if connection is not None:
        verdict = sent_admit(connection, task_id, key, dedupe_key=dedupe_key, arrival_timeout=timeout)
    else:
        verdict = publisher.ledger.admit_at_send(task_id, key, dedupe_key=dedupe_key, arrival_timeout=timeout)
    if not verdict.accepted:
        raise SendRefused(task_id, key, verdict)
    return verdict.detail != "known"


def forget_send(app: Any, task_id: str) -> None:
    """Give back the place reserved at send for ``task_id`` (its publish raised)."""
    publisher = publisher_for(app)
    if publisher is not None:
        publisher.ledger.forget_send(task_id)


def admits_at_send(app: Any, name: str) -> bool:
    """Whether the configuration of ``name`` asks producers to admit at send (``admit_at_send`` in
    ``keyed_concurrency_limits``); False when the app has no ledger configuration."""
    publisher = publisher_for(app)
    config = publisher.settings.limits.get(name) if publisher is not None else None
    return bool(config is not None and config.admit_at_send)


def publisher_for(app: Any, *, required: bool = False) -> Publisher | None:
    """The ledger access of ``app`` in this process, or None when the app has no usable ledger configuration
    (publishing goes on without the ledger). ``required``: raise the configuration error instead (an operator's
    call such as ``set_limit`` must say what is wrong: a missing URL, a non-PostgreSQL URL, a value out of range)."""
    current: Publisher | None = getattr(app, "_keyed_publisher", None)
    if current is not None and current.pid == os.getpid():
        return current
    with _lock:
        current = getattr(app, "_keyed_publisher", None)
        if current is not None and current.pid == os.getpid():
            return current
        try:
            settings = read_settings(app.conf)
            engine = create_ledger_engine(settings)
        except Exception:
            if required:
                raise
            return None
        current = Publisher(settings, engine, os.getpid())
        app._keyed_publisher = current
        return current


def close_publisher(app: Any) -> None:
    """Dispose of ``app``'s ledger connections in this process (tests, or an app that is being closed)."""
    current: Publisher | None = getattr(app, "_keyed_publisher", None)
    if current is not None:
        app._keyed_publisher = None
        current.engine.dispose()
