"""The producer side's access to the ledger (group registration at publish, D10): one engine per process
and app, created on first use (a forked pool child creates its own)."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from celery_keyed.engine import create_ledger_engine
from celery_keyed.settings import KeyedSettings, read_settings

_lock = threading.Lock()


@dataclass
class Publisher:
    settings: KeyedSettings
    engine: sa.Engine
    pid: int


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
