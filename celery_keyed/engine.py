"""The ledger's SQLAlchemy engine for a Celery process: bounded connect and statement times, so a ledger call
from the consumer loop can never block it for long (DESIGN §5), and durable commits. The ledger is PostgreSQL only
(row locks, ``SKIP LOCKED``, advisory locks, ``jsonb``): any other URL is a configuration error, said at once.

Directly connected, the statement timeout and ``synchronous_commit`` are session settings sent at connect; behind a
connection pooler (PgBouncer, in session or transaction mode) they are set per transaction and server-side prepared
statements are off (``celery_keyed.ledger.session``). ``keyed_pooler`` says which; unset, the engine finds out: a
pooler refuses the startup options, or drops them."""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import psycopg
import sqlalchemy as sa

from celery_keyed.ledger import InvalidConfig, per_transaction, settings_in_effect, startup_options
from celery_keyed.settings import KeyedSettings

logger = logging.getLogger("celery_keyed")

#: Errors that mean "the ledger cannot be reached now" (the breaker opens, the request is held, D9), as opposed
#: to the ledger refusing a message's data (a recorded rejection, D16).
UNREACHABLE: tuple[type[BaseException], ...] = (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError)

#: What a pooler answers to startup options it does not pass on (PgBouncer: "unsupported startup parameter: options").
_REFUSED_OPTIONS = "unsupported startup parameter"


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


def create_ledger_engine(
    settings: KeyedSettings, *, pinned: int = 0, statement_timeout: float | None = None
) -> sa.Engine:
    """The ledger's engine: ``keyed_pool_size`` connections kept (as many again may overflow), plus ``pinned`` for
    the threads that keep one each for their lifetime (the worker's admission, receipt and releaser threads,
    ``Ledger.pinned``), so that those never leave the heartbeat, the sweeper or the loop waiting for one.
    ``statement_timeout``: seconds instead of ``keyed_statement_timeout``, 0 for none (migrations)."""
    url, from_url = _driver_args_from_url(ledger_url(settings.database_url))
    user_args = {**from_url, **settings.connect_args}
    try:
        engine = sa.create_engine(
            url,
            pool_size=settings.pool_size + pinned,
            max_overflow=settings.pool_size,
            pool_timeout=settings.connect_timeout,
            connect_args={
                "connect_timeout": max(1, math.ceil(settings.connect_timeout)),
                "application_name": "celery-keyed",
                **tcp_keepalive_args(settings),
                **user_args,
            },
        )
    except (ImportError, sa.exc.NoSuchModuleError) as exc:
        raise InvalidConfig(
            f"keyed_database_url names a PostgreSQL driver that is not installed ({exc}): use "
            "postgresql+psycopg:// (psycopg 3, installed with celery-keyed)"
        ) from None
    timeout = settings.statement_timeout if statement_timeout is None else statement_timeout
    SessionSettings(timeout, pooler=settings.pooler, user_args=user_args).install(engine)
    return engine


#: psycopg connection attributes that a URL's query may carry (SQLAlchemy passes them on as strings, which psycopg
#: does not take): ``?prepare_threshold=none`` (or a number).
_DRIVER_ARGS = ("prepare_threshold",)


def _driver_args_from_url(url: sa.URL) -> tuple[sa.URL, dict[str, Any]]:
    """``url`` without the driver arguments of its query (``_DRIVER_ARGS``), and those as psycopg takes them."""
    found: dict[str, Any] = {}
    for name in _DRIVER_ARGS:
        if name not in url.query:
            continue
        raw = url.query[name]
        value = raw[-1] if isinstance(raw, tuple) else raw
        if value.strip().lower() in ("", "none", "null"):
            found[name] = None
        else:
            try:
                found[name] = int(value)
            except ValueError:
                raise InvalidConfig(
                    f"keyed_database_url: {name} must be a whole number or 'none', got {value!r}"
                ) from None
    return url.difference_update_query(list(found)), found


class SessionSettings:
    """Gives the ledger's connections of one engine their statement timeout and durable commits: at connect when
    the session keeps them (a direct connection), per transaction behind a pooler (see ``ledger.session``).

    ``pooler``: True / False as configured (``keyed_pooler``), None to find out on the first connection: a pooler
    refuses the startup options (the connection is made again without them) or drops them (found by reading the
    settings back). Behind a pooler psycopg's server-side prepared statements are off too, unless the user's
    connect arguments set ``prepare_threshold``."""

    def __init__(self, statement_timeout: float, *, pooler: bool | None, user_args: dict[str, Any]) -> None:
        self.statement_timeout = statement_timeout
        self.configured = pooler
        self.pooler = pooler
        self.user_args = user_args
        self.cursor_class = per_transaction(statement_timeout)
        self._lock = threading.Lock()

    def install(self, engine: sa.Engine) -> None:
        sa.event.listen(engine, "do_connect", self.on_do_connect)
        sa.event.listen(engine, "connect", self.on_connect)

    def on_do_connect(self, dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
        if self.pooler or "options" in self.user_args:
            return None  # the defaults: no options of ours
        try:
            return dialect.connect(*cargs, **{**cparams, "options": startup_options(self.statement_timeout)})
        except psycopg.OperationalError as exc:
            if _REFUSED_OPTIONS not in str(exc):
                raise
        self._found_pooler("it refused the startup options")
        return None  # connect again without them

    def on_connect(self, dbapi_connection: Any, record: Any) -> None:
        if not isinstance(dbapi_connection, psycopg.Connection):
            return
        if self.configured is None and not self.pooler and not settings_in_effect(
            dbapi_connection, self.statement_timeout
        ):
            self._found_pooler("it dropped the startup options")
        if self.pooler or "options" in self.user_args:
            dbapi_connection.cursor_factory = self.cursor_class
            if "prepare_threshold" not in self.user_args:
                dbapi_connection.prepare_threshold = None

    def _found_pooler(self, how: str) -> None:
        with self._lock:
            if self.pooler:
                return
            self.pooler = True
        logger.info(
            "celery-keyed: the ledger's database is behind a connection pooler (%s): statement timeouts and durable"
            " commits are set per transaction, server-side prepared statements are off (keyed_pooler = True says"
            " so and skips the check)",
            how,
        )


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
