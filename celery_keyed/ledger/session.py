"""The ledger's sessions: what every ledger transaction runs with, and how the ledger runs its transactions.

:class:`LedgerSession` holds an engine and one holder (a worker process start, D6): the pooled connections, the
per-thread pinned connection of a service thread (``pinned``), transactions retried on a deadlock or a
serialization failure (``transaction``, ``autocommitted``) and the warm-up of a fresh connection (``warm_up``).
The ``Ledger`` facade is a session with one method per operation; the batch policy (``batches``) runs on one.

The settings, kept without session state a connection pooler would lose:

Every ledger transaction has a statement timeout (``keyed_statement_timeout``: a ledger call from the consumer loop
can never block it for long) and commits durably (``synchronous_commit = on``, whatever the server's default: a
broker message is acknowledged after the ledger commit that took it over — a parked row, a claim, a release — and
a commit the server may still lose after saying it is done would lose the task with it).

Two ways to give them, chosen per engine (``engine.create_ledger_engine``):

- **At connect** (a direct connection to PostgreSQL): the startup packet's ``options`` set both for the session;
  the hot path sends nothing more. Checked once per connection (``settings_in_effect``): a pooler that drops the
  options silently (PgBouncer's ``ignore_startup_parameters = options``) is found out.
- **Per transaction** (behind a pooler: PgBouncer refuses ``options`` at connect, and in transaction mode a server
  connection is someone else's after each transaction): :class:`PerTransaction`, a psycopg cursor that starts each
  transaction with ``SET LOCAL``-scoped ``set_config`` calls *pipelined* with its first statement, so no round trip
  is added (one statement is: the settings). Server-side prepared statements are off there too (psycopg's
  ``prepare_threshold = None``): a transaction pooler hands the next transaction to a server connection that never
  saw them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, TypeVar

import psycopg
import sqlalchemy as sa
from psycopg import pq
from sqlalchemy.exc import DBAPIError, IntegrityError

from celery_keyed.ledger import admit, release
from celery_keyed.ledger.attempts import Arrival, Outcome, ReleaseRequest, Token, Verdict
from celery_keyed.ledger.errors import on_handle_error, translate
from celery_keyed.ledger.holders import new_holder
from celery_keyed.ledger.identity import watch_engine
from celery_keyed.ledger.promote import DEFAULT_DISPATCH_TIMEOUT

T = TypeVar("T")

logger = logging.getLogger("celery_keyed")

#: SQLSTATEs that mean "nothing happened, run the transaction again".
RETRYABLE = {"40P01", "40001"}  # deadlock_detected, serialization_failure

#: The ledger's commits are durable whatever the server's default (see the module docstring).
SYNCHRONOUS_COMMIT = "on"


# server_unsafe_settings: the server settings under which a commit PostgreSQL reported may be lost (fsync off: by a
# crash of the machine) or the database corrupted (full_page_writes off), whatever a transaction sets.
SERVER_UNSAFE_SETTINGS = sa.text(
    "SELECT name FROM pg_settings WHERE name IN ('fsync', 'full_page_writes') AND setting = 'off' ORDER BY name"
)


def server_unsafe_settings(conn: sa.Connection) -> list[str]:
    """The server's settings that make the ledger's commits not durable (``SERVER_UNSAFE_SETTINGS``), if any."""
    return list(conn.execute(SERVER_UNSAFE_SETTINGS).scalars())


def timeout_ms(seconds: float) -> int:
    """A timeout in seconds as PostgreSQL's whole milliseconds: at least 1 (0 means "no timeout", asked by 0)."""
    return max(1, round(seconds * 1000)) if seconds > 0 else 0


def startup_options(statement_timeout: float) -> str:
    """The ``options`` startup parameter of a direct connection: the ledger's settings for the whole session."""
    return f"-c statement_timeout={timeout_ms(statement_timeout)} -c synchronous_commit={SYNCHRONOUS_COMMIT}"


def settings_in_effect(conn: psycopg.Connection[Any], statement_timeout: float) -> bool:
    """Whether ``conn``'s session runs with the ledger's settings (the startup options were kept). Leaves ``conn``
    as it found it (idle, or in autocommit)."""
    row = conn.execute(
        "SELECT (SELECT setting FROM pg_settings WHERE name = 'statement_timeout'),"
        " current_setting('synchronous_commit')",
        prepare=False,
    ).fetchone()
    if not conn.autocommit:
        conn.rollback()
    return row is not None and row[0] == str(timeout_ms(statement_timeout)) and row[1] == SYNCHRONOUS_COMMIT


def per_transaction(statement_timeout: float) -> type[PerTransaction]:
    """A :class:`PerTransaction` cursor class giving ``statement_timeout`` (seconds) and a durable commit."""
    ms = timeout_ms(statement_timeout)
    return type(
        "PerTransaction",
        (PerTransaction,),
        {
            "settings": (
                f"SELECT set_config('statement_timeout', '{ms}', true),"
                f" set_config('synchronous_commit', '{SYNCHRONOUS_COMMIT}', true)"
            )
        },
    )


class PerTransaction(psycopg.Cursor[Any]):
    """A psycopg cursor that gives each transaction the ledger's settings, local to the transaction (nothing is left
    on the server connection for the next client of a pooler).

    The statement that starts a transaction — the first after BEGIN, or any statement in autocommit (its own
    transaction) — is sent in a pipeline behind ``settings`` (``set_config(..., true)``, that is ``SET LOCAL``): one
    round trip, as before. PostgreSQL runs the statements of a pipeline up to its sync in one transaction and starts
    each statement's timeout when it begins, so the timeout applies to the statement itself, and the commit at the
    end of the transaction reads ``synchronous_commit``. Statements later in an open transaction need nothing."""

    settings: ClassVar[str] = ""

    def execute(
        self, query: Any, params: Any = None, *, prepare: bool | None = None, binary: bool | None = None
    ) -> Any:
        conn = self.connection
        if conn._pipeline is not None or conn.pgconn.transaction_status != pq.TransactionStatus.IDLE:
            return super().execute(query, params, prepare=prepare, binary=binary)
        if params is None and isinstance(query, str) and ";" in query:
            # a script (several statements, the simple protocol: not in a pipeline): the settings lead it, and their
            # result is skipped
            super().execute(f"{self.settings}; {query}", prepare=prepare, binary=binary)
            self.nextset()
            return self
        with conn.pipeline():
            psycopg.Cursor(conn).execute(self.settings, prepare=False)
            super().execute(query, params, prepare=prepare, binary=binary)
        return self

    def executemany(self, query: Any, params_seq: Iterable[Any], *, returning: bool = False) -> None:
        conn = self.connection
        if conn._pipeline is not None or conn.pgconn.transaction_status != pq.TransactionStatus.IDLE:
            super().executemany(query, params_seq, returning=returning)
            return
        with conn.pipeline():
            psycopg.Cursor(conn).execute(self.settings, prepare=False)
            super().executemany(query, params_seq, returning=returning)


def sqlstate(exc: DBAPIError) -> str | None:
    """The SQLSTATE of a driver error (None when the driver gave none)."""
    return getattr(getattr(exc.orig, "diag", None), "sqlstate", None) or getattr(exc.orig, "sqlstate", None)


class LedgerSession:
    """The ledger's connections, bound to an engine and to one holder (a worker process start, D6).

    ``lease`` is how long a claim lives without renewal; ``dispatch`` how long a promoted attempt may wait to be
    bound. Every operation of the ledger runs ``work(conn)`` through ``transaction`` (one transaction, retried) or
    ``autocommitted`` (a self-committing call, retried)."""

    def __init__(
        self,
        engine: sa.Engine,
        *,
        holder: str | None = None,
        lease: float = 60.0,
        dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    ) -> None:
        self.engine = engine
        if not sa.event.contains(engine, "handle_error", on_handle_error):
            sa.event.listen(engine, "handle_error", on_handle_error)  # PostgreSQL's own limits are data errors
        watch_engine(engine, lease=lease)  # D20: a new connection's first contact with a server checks its identity
        #: The same pool in autocommit: the single-statement fast paths need no BEGIN / COMMIT round trips.
        self.autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self.holder = holder or new_holder()
        self.lease = lease
        self.dispatch = dispatch
        #: Per thread: the autocommit connection a service thread keeps between its calls (``pinned``).
        self._pins = threading.local()

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """While the context is open, this thread's self-committing calls (``autocommitted``, the fast claim,
        ``confirm``) reuse one connection of the pool instead of checking one out and back in for each call.

        For the worker's service threads (admission, receipt, releaser), which make such a call per keyed task:
        the checkout, the isolation level set on it and reset on its return, cost about 75 µs of the worker's main
        process CPU per call, a third of a call's client CPU. The connection goes back to the pool when the context
        ends, and is dropped (the next call takes another from the pool) as soon as a call finds it broken or
        invalidated (the database restarted, a network error): each thread then fails at most one call on a dead
        connection, which the callers already retry like any call that lost the database."""
        if getattr(self._pins, "depth", 0):
            self._pins.depth += 1
            try:
                yield
            finally:
                self._pins.depth -= 1
            return
        self._pins.depth = 1
        self._pins.conn = None
        try:
            yield
        finally:
            self._pins.depth = 0
            conn, self._pins.conn = self._pins.conn, None
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()

    @contextlib.contextmanager
    def autocommit_connection(self) -> Iterator[sa.Connection]:
        """A connection in autocommit: this thread's pinned one (``pinned``), else one checked out for the call."""
        if not getattr(self._pins, "depth", 0):
            with self.autocommit.connect() as conn:
                yield conn
            return
        conn = self._pins.conn
        if conn is None or conn.closed or conn.invalidated:
            self._drop_pin()
            conn = self._pins.conn = self.autocommit.connect()
        try:
            yield conn
        except BaseException:
            if conn.invalidated or conn.closed:
                self._drop_pin()
            raise
        finally:
            if self._pins.conn is conn and conn.in_transaction():
                # SQLAlchemy's autobegin (a statement run through conn.execute); nothing is open on the server
                # in autocommit, and ending it keeps the next call from running inside it.
                try:
                    conn.rollback()
                except Exception:
                    self._drop_pin()

    def _drop_pin(self) -> None:
        conn, self._pins.conn = self._pins.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def transaction(self, work: Callable[[sa.Connection], T], *, attempts: int = 5) -> T:
        """Run ``work(conn)`` in a transaction; retry it on deadlock or serialization failure. A violated named
        constraint raises its domain error (``errors.translate``: :class:`InvalidConfig` or :class:`WrongState`)."""
        for attempt in range(attempts):
            try:
                with self.engine.begin() as conn:
                    return work(conn)
            except IntegrityError as exc:  # a named constraint (CHECK, UNIQUE) becomes its domain error
                domain = translate(exc)
                if domain is exc:
                    raise
                raise domain from exc
            except DBAPIError as exc:
                if sqlstate(exc) not in RETRYABLE or attempt == attempts - 1:
                    raise
                time.sleep(0.001 * (2**attempt))
        raise AssertionError("unreachable")

    def autocommitted(self, work: Callable[[sa.Connection], T], *, attempts: int = 5) -> T:
        """Run ``work(conn)`` on a connection in autocommit (each statement its own transaction: a server-side path
        is one call, one round trip); retried like ``transaction`` on deadlock or serialization failure, which
        roll the failed statement back. ``work`` must be one statement, or statements each safe alone."""
        for attempt in range(attempts):
            try:
                with self.autocommit_connection() as conn:
                    return work(conn)
            except DBAPIError as exc:
                if sqlstate(exc) not in RETRYABLE or attempt == attempts - 1:
                    raise
                time.sleep(0.001 * (2**attempt))
        raise AssertionError("unreachable")


    def warm_up(self) -> bool:
        """Open this thread's connection and run the hot path once on it, rolled back: claims, an arrival parked
        behind one of them, a release that promotes it and one that finds nobody waiting, and the fast claim.

        A new backend compiles the ledger's PL/pgSQL functions and plans their statements on first use (and loads
        the catalog entries of every table they touch); together with the connection's own start that made the
        first handoff of a fresh worker 30-60 ms slower than the next ones (docs/benchmarks.md). The worker's
        service threads call it in their pinned context (``pinned``) once the worker received its first keyed task.
        Everything runs in one explicit transaction block that is rolled back, on keys of a name of its own
        (``keyed-warm-up-<random>``), so nothing is left behind and no lock of another name or key is taken; only
        the fence sequence may move on. Never raises: a ledger that cannot be reached is the breaker's business when a
        real call finds it. True when the whole path ran (claimed, parked, released and promoted)."""
        try:
            with self.autocommit_connection() as conn:
                raw = conn.connection.driver_connection
                if not isinstance(raw, psycopg.Connection) or not raw.autocommit:
                    return False
                raw.execute("BEGIN")
                try:
                    # a name of its own (the name's rows, inserted and rolled back, would make two threads warming
                    # up at once wait for each other)
                    name = f"keyed-warm-up-{uuid.uuid4().hex[:16]}"
                    key, other = f"{name}:1", f"{name}:2"
                    first, second, third, fourth = (
                        Arrival(task_id=f"{k}:{n}", key=k, task_name="keyed.warm_up", queue="keyed.warm_up")
                        for k, n in ((key, 1), (key, 2), (other, 3), (other, 4))
                    )
                    queues = tasks = frozenset({"keyed.warm_up"})
                    # a key's first arrival (keyed_admit_plain), one parked behind it, the release that promotes
                    # it; another key's first arrival, its release with nobody waiting, then the fast claim of a
                    # known key with room (CLAIM_NEW)
                    claimed, _ = admit.admit_plain(conn, first, holder=self.holder, lease=self.lease)
                    parked, _ = admit.admit_plain(conn, second, holder=self.holder, lease=self.lease)
                    alone, _ = admit.admit_plain(conn, third, holder=self.holder, lease=self.lease)
                    if claimed is None or parked is None or alone is None:
                        return False
                    done = release.release_and_promote(
                        conn,
                        [
                            ReleaseRequest(Token(t.task_id, 0), a.fence or 0, Outcome.COMPLETED,
                                           local_queues=queues, local_tasks=tasks)
                            for t, a in ((first, claimed), (third, alone))
                        ],
                        holder=self.holder, lease=self.lease,
                    )
                    fast, _ = admit.admit_autocommit(conn, fourth, holder=self.holder, lease=self.lease)
                    return (
                        parked.verdict is Verdict.PARKED
                        and [p.task_id for p in done.promotions] == [second.task_id]
                        and fast is not None
                        and fast.verdict is Verdict.ADMITTED
                    )
                finally:
                    if not raw.closed:
                        raw.execute("ROLLBACK")
        except Exception:
            logger.debug("celery-keyed: warming the ledger connection up failed", exc_info=True)
            if getattr(self._pins, "depth", 0):
                self._drop_pin()  # whatever state it was left in, the next call starts on a fresh connection
            return False

