"""What every ledger transaction runs with, kept without session state a connection pooler would lose.

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

from collections.abc import Iterable
from typing import Any, ClassVar

import psycopg
import sqlalchemy as sa
from psycopg import pq

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
