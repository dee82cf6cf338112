"""The ledger's SQLAlchemy engine for a Celery process: bounded connect and statement times, so a ledger call
from the consumer loop can never block it for long (DESIGN §5). The ledger is PostgreSQL only (row locks,
``SKIP LOCKED``, advisory locks, ``jsonb``): any other URL is a configuration error, said at once."""

from __future__ import annotations

import math

import sqlalchemy as sa

from celery_keyed.ledger import InvalidConfig
from celery_keyed.settings import KeyedSettings


def ledger_url(database_url: str) -> sa.URL:
    """The parsed ``keyed_database_url``; :class:`InvalidConfig` unless it is a PostgreSQL URL."""
    try:
        url = sa.engine.make_url(database_url)
    except sa.exc.ArgumentError:
        raise InvalidConfig(
            "keyed_database_url is not a database URL: the ledger needs PostgreSQL, e.g. "
            "postgresql+psycopg://user:password@host/dbname"
        ) from None
    if url.get_backend_name() != "postgresql":
        raise InvalidConfig(
            f"keyed_database_url must be a PostgreSQL URL (postgresql+psycopg://...): the ledger needs PostgreSQL,"
            f" got a {url.get_backend_name()!r} URL ({url.render_as_string(hide_password=True)})"
        )
    return url


def create_ledger_engine(settings: KeyedSettings, *, pinned: int = 0) -> sa.Engine:
    """The ledger's engine: ``keyed_pool_size`` connections kept (as many again may overflow), plus ``pinned`` for
    the threads that keep one each for their lifetime (the worker's admission, receipt and releaser threads,
    ``Ledger.pinned``), so that those never leave the heartbeat, the sweeper or the loop waiting for one."""
    url = ledger_url(settings.database_url)
    try:
        return sa.create_engine(
            url,
            pool_size=settings.pool_size + pinned,
            max_overflow=settings.pool_size,
            pool_timeout=settings.connect_timeout,
            connect_args={
                "connect_timeout": max(1, math.ceil(settings.connect_timeout)),
                "options": f"-c statement_timeout={max(1, round(settings.statement_timeout * 1000))}",
                "application_name": "celery-keyed",
                **tcp_keepalive_args(settings),
            },
        )
    except (ImportError, sa.exc.NoSuchModuleError) as exc:
        raise InvalidConfig(
            f"keyed_database_url names a PostgreSQL driver that is not installed ({exc}): use "
            "postgresql+psycopg:// (psycopg 3, installed with celery-keyed)"
        ) from None


def tcp_keepalive_args(settings: KeyedSettings) -> dict[str, int]:
    """libpq's TCP keepalives and user timeout for the ledger's connections, derived from the self-fence margin
    (D19): a connection whose server went silent (a partition: no answer, no reset) is declared dead by the kernel
    within about half the margin — idle ``margin / 4`` then 3 probes ``margin / 8`` apart, and data left unacknowledged
    for ``margin / 2`` — so a worker finds the ledger unreachable before its leases could lapse. (libpq counts
    keepalives in whole seconds, at least 1: for a margin under ~8 s they take longer; the self-fence's own timer
    never depends on them.)"""
    margin = settings.self_fence_margin
    return {
        "keepalives": 1,
        "keepalives_idle": max(1, int(margin / 4)),
        "keepalives_interval": max(1, int(margin / 8)),
        "keepalives_count": 3,
        "tcp_user_timeout": max(1000, int(margin * 1000 / 2)),
    }
