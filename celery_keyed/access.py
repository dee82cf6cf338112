"""An app's way into its ledger, and the one way to start the promotions a ledger change made.

- ``ledger_on(engine, timing, holder=...)``: the one builder of a :class:`~celery_keyed.ledger.Ledger` — on an
  engine, with the app's lease and dispatch timeout (``keyed_lease``, ``keyed_dispatch_timeout``). The worker's
  gate, the CLI and the Django app (each on an engine of its own) build theirs with it.
- ``ledger_for(app)``: the ledger of ``app`` in this process, on its producer-side engine (``publisher_for``):
  beat's reconcile, the package API (``set_limit``...) and the task (``release_concurrency``) use it.
- ``dispatch(app, promotions)``: publish each promoted attempt with its admission nonce (D5) through the app's
  broker, with one policy for broker errors: the ledger change that made the promotion is committed already, and a
  promotion that cannot be published stays in the ledger and goes back in line after ``keyed_dispatch_timeout``
  (the reaper voids it, D5) — so a broker error is logged as a warning and counted, never raised, and the other
  promotions are still published. The caller reads the :class:`Dispatched` report (the CLI prints it).

``Publisher`` / ``publisher_for`` hold the app's settings, engine and ledger per process (a forked pool child
creates its own).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import sqlalchemy as sa

from celery_keyed.engine import create_ledger_engine
from celery_keyed.ledger import Ledger, Promotion
from celery_keyed.messages import Dispatched as Dispatched  # re-exported: dispatch's report
from celery_keyed.messages import publish_promoted
from celery_keyed.settings import KeyedSettings, read_settings

logger = logging.getLogger("celery_keyed")

_lock = threading.Lock()


class Timing(Protocol):
    """What a ledger takes from the settings (``KeyedSettings`` has both)."""

    @property
    def lease(self) -> float: ...

    @property
    def dispatch_timeout(self) -> float: ...


def ledger_on(engine: sa.Engine, timing: Timing, *, holder: str | None = None) -> Ledger:
    """The ledger on ``engine`` with the lease and dispatch timeout of ``timing``; ``holder``: the worker start
    whose claims it takes (None: a fresh holder id; producers and operators hold no claim)."""
    return Ledger(engine, holder=holder, lease=timing.lease, dispatch=timing.dispatch_timeout)


@dataclass
class Publisher:
    """The ledger access of one app in one process: its settings, its engine and its ledger."""

    settings: KeyedSettings
    engine: sa.Engine
    pid: int
    _ledger: Ledger | None = field(default=None, repr=False)

    @property
    def ledger(self) -> Ledger:
        """A ledger on this publisher's engine (producer calls hold no claim: no holder of their own matters)."""
        ledger = self._ledger
        if ledger is None:
            ledger = self._ledger = ledger_on(self.engine, self.settings)
        return ledger


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


def ledger_for(app: Any) -> Ledger:
    """The ledger of ``app`` in this process; a missing or bad ledger configuration raises its error."""
    publisher = publisher_for(app, required=True)
    assert publisher is not None  # required: a configuration error was raised
    return publisher.ledger


def dispatch(app: Any, promotions: Iterable[Promotion]) -> Dispatched:
    """Publish each promoted attempt with its admission nonce; a broker error is a warning and the other promotions
    are still published (``messages.publish_promoted``: the one policy, see the module docstring)."""
    return publish_promoted(app, promotions)
