"""The Django app's way into the ledger: a SQLAlchemy engine on the Django database that holds the ledger, the
``Ledger`` facade on it, and the dispatch of the promotions an operator's change makes.

Settings (Django ``settings.py``, the names Celery users already use with ``namespace="CELERY"``):

- ``CELERY_KEYED_DATABASE``: alias of the database that holds the ledger (default ``"default"``; the older name
  ``CELERY_KEYED_DJANGO_DATABASE`` still works). The workers read the same setting (``keyed_database`` with
  ``namespace="CELERY"``) and build their ledger URL from that entry of ``DATABASES``, so
  ``CELERY_KEYED_DATABASE_URL`` need not repeat it;
- ``CELERY_KEYED_CELERY_APP``: the Celery app (or its dotted path, ``"proj.celery:app"``) used to republish
  promotions; default: Celery's current app when ``celery_keyed.install()`` ran on it. Without one, promoted
  attempts are started by a worker's sweeper once their dispatch deadline passes;
- ``CELERY_KEYED_DISPATCH_TIMEOUT`` / ``CELERY_KEYED_LEASE`` / ``CELERY_KEYED_STATEMENT_TIMEOUT`` /
  ``CELERY_KEYED_POOLER``: as the workers' ``keyed_*`` settings (the admin's connections follow the same session
  rules as the workers': see ``engine_for``);
- ``CELERY_KEYED_CONCURRENCY_LIMITS``: the names configured in code (used to flag unknown names).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import import_module
from typing import Any

import sqlalchemy as sa
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from sqlalchemy.pool import NullPool

from celery_keyed.access import dispatch as dispatch_promotions
from celery_keyed.access import ledger_on
from celery_keyed.engine import SessionSettings
from celery_keyed.ledger import DEFAULT_DISPATCH_TIMEOUT, Ledger, Promotion
from celery_keyed.ledger.bounds import check_seconds

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_engines: dict[tuple[str, str], sa.Engine] = {}

#: Connection parameters Django adds for its own cursor machinery; a plain psycopg connection takes none of them.
_DJANGO_ONLY_PARAMS = ("cursor_factory", "context", "prepare_threshold")


def database_alias() -> str:
    """The Django database alias that holds the ledger's tables."""
    alias = getattr(settings, "CELERY_KEYED_DATABASE", None) or getattr(settings, "CELERY_KEYED_DJANGO_DATABASE", None)
    return str(alias or "default")


def connection_params(wrapper: BaseDatabaseWrapper) -> dict[str, Any]:
    """``psycopg.connect`` keyword arguments for the database of a Django connection."""
    if wrapper.vendor != "postgresql":
        raise RuntimeError(f"celery-keyed's ledger needs PostgreSQL; database {wrapper.alias!r} is {wrapper.vendor}")
    params = dict(wrapper.get_connection_params())
    for name in _DJANGO_ONLY_PARAMS:
        params.pop(name, None)
    return params


def engine_for(
    wrapper: BaseDatabaseWrapper, *, pooled: bool = True, statement_timeout: float | None = None
) -> sa.Engine:
    """A SQLAlchemy engine on the database of a Django connection (``pooled=False``: one connection per use), with
    the workers' session rules (``celery_keyed.engine.SessionSettings``): the statement timeout
    (``CELERY_KEYED_STATEMENT_TIMEOUT``, or ``statement_timeout`` seconds, 0 for none) and durable commits set at
    connect on a direct connection, per transaction behind a pooler (``CELERY_KEYED_POOLER``: True / False, unset
    to detect it as the workers do) — where server-side prepared statements are off too, unless the database's
    ``OPTIONS`` set ``prepare_threshold``."""
    params = connection_params(wrapper)
    own = dict(wrapper.settings_dict.get("OPTIONS") or {})
    if "prepare_threshold" in own:  # the user's choice for this database (e.g. None behind PgBouncer): kept
        params["prepare_threshold"] = own["prepare_threshold"]
    timeout = _float_setting("CELERY_KEYED_STATEMENT_TIMEOUT", 5.0) if statement_timeout is None else statement_timeout
    pooler = getattr(settings, "CELERY_KEYED_POOLER", None)
    if pooler is not None and not isinstance(pooler, bool):
        raise ImproperlyConfigured(f"CELERY_KEYED_POOLER must be True, False or None, got {pooler!r}")
    # No creator: SQLAlchemy's own connect (with these arguments) is what the session rules' connect hook wraps.
    pool_args: dict[str, Any] = (
        {"pool_size": 2, "max_overflow": 4, "pool_pre_ping": True} if pooled else {"poolclass": NullPool}
    )
    engine = sa.create_engine("postgresql+psycopg://", connect_args=params, **pool_args)
    SessionSettings(timeout, pooler=pooler, user_args={k: v for k, v in params.items() if k in own}).install(engine)
    return engine


def ledger_engine() -> sa.Engine:
    """The process's engine on the ledger database (created on first use, per database name)."""
    wrapper = connections[database_alias()]
    cache_key = (wrapper.alias, str(wrapper.settings_dict.get("NAME")))
    with _lock:
        engine = _engines.get(cache_key)
        if engine is None:
            engine = _engines[cache_key] = engine_for(wrapper)
        return engine


def dispose_engines() -> None:
    """Close the ledger connections of this process (tests; a server that forks after startup)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()


def _float_setting(name: str, default: float) -> float:
    """A duration setting in seconds, in the range the workers' settings have (``ledger/bounds.py``)."""
    value = getattr(settings, name, None)
    if isinstance(value, str):  # e.g. read from the environment
        with contextlib.suppress(ValueError):
            value = float(value)
    return default if value is None else check_seconds(value, name)


@dataclass(frozen=True)
class Timing:
    """The lease and dispatch timeout of the ledger, from Django's settings (``access.Timing``)."""

    lease: float
    dispatch_timeout: float


def get_ledger() -> Ledger:
    """The ledger facade on the Django database (each call of its methods is one transaction)."""
    timing = Timing(
        lease=_float_setting("CELERY_KEYED_LEASE", 60.0),
        dispatch_timeout=_float_setting("CELERY_KEYED_DISPATCH_TIMEOUT", DEFAULT_DISPATCH_TIMEOUT),
    )
    return ledger_on(ledger_engine(), timing, holder="django-admin:0:0")


def configured_names() -> set[str]:
    """Names configured in this project's settings (``CELERY_KEYED_CONCURRENCY_LIMITS``)."""
    limits = getattr(settings, "CELERY_KEYED_CONCURRENCY_LIMITS", None) or {}
    return set(limits)


def celery_app() -> Any | None:
    """The Celery app that republishes promotions, or None (see the module's docstring)."""
    app = getattr(settings, "CELERY_KEYED_CELERY_APP", None)
    if isinstance(app, str):
        module, _, attr = app.replace(":", ".").rpartition(".")
        app = getattr(import_module(module), attr)
    if app is None:
        from celery import current_app

        app = current_app._get_current_object()
        if not getattr(app, "_keyed_installed", False):
            return None
    return app


def dispatch(promotions: Iterable[Promotion]) -> int:
    """Start promoted attempts: republish each with its admission nonce (D5) through the Celery app
    (``access.dispatch``: a broker error is a warning). Returns how many were published; the others start through a
    worker's sweeper after their deadline."""
    promotions = [p for p in promotions if p.nonce is not None]
    if not promotions:
        return 0
    app = celery_app()
    if app is None:
        return 0
    return dispatch_promotions(app, promotions).published
