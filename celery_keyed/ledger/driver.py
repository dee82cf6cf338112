"""The hot path's statements on the driver: one self-committing call per task run by psycopg directly, not through
SQLAlchemy's execution machinery.

Why (a profile, not a taste): on bench.gate's scenario b (1,000 uncontended keys, a c=2 prefork worker), the worker's
main process spent 6.2 ms of CPU per keyed task against 1.8 ms for plain Celery; 42 % of the ledger threads' share
was SQLAlchemy (statement caching and compilation lookups, parameter processing, the result proxy and its Row
objects) and 35 % psycopg. The two calls every uncontended task makes (the fast claim, ``fast_paths.CLAIM_NEW``, and
the release, ``fast_paths.RELEASE_AND_PROMOTE``) cost 1.4-1.8 ms of Python CPU per claim-and-release through
SQLAlchemy and 0.5-0.7 ms on the driver (same statements, same server, same run). That CPU competes with the
consumer loop for the GIL and with PostgreSQL for the machine's cores.

What stays the same: the statement text (the ``sa.text`` constants of the table modules, converted once to psycopg's
``%(name)s`` placeholders), the connection (the SQLAlchemy connection's own, checked out of the ledger's pool, in
autocommit), the values (``sa.text`` statements carry no types: SQLAlchemy hands the values to psycopg unchanged and
returns what psycopg returns), the errors (a driver error becomes the ``sqlalchemy.exc.DBAPIError`` subclass
SQLAlchemy would raise, so the breaker, the retries and ``errors.translate`` see what they always saw; a connection
the server dropped is invalidated, as SQLAlchemy does), and the ``before_cursor_execute`` / ``after_cursor_execute``
events (tests and bench.ledger count round trips with them). A connection in a transaction is left to SQLAlchemy:
only autocommit calls take this path.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg.rows import namedtuple_row

from celery_keyed.ledger.errors import as_data_error, as_operational_error, data_refused, infrastructure_fault

_PLACEHOLDER = re.compile(r"(?<![:\w\\]):([A-Za-z_]\w*)")
_converted: dict[int, tuple[sa.TextClause, str]] = {}


def driver_sql(statement: sa.TextClause) -> str:
    """``statement``'s text with psycopg's named placeholders (``:name`` -> ``%(name)s``, ``%`` -> ``%%``); a
    ``::type`` cast is not a placeholder. Converted once per statement object."""
    entry = _converted.get(id(statement))
    if entry is None or entry[0] is not statement:
        text = _PLACEHOLDER.sub(r"%(\1)s", statement.text.replace("%", "%%")).replace("\\:", ":")
        entry = (statement, text)
        _converted[id(statement)] = entry
    return entry[1]


def array_literal(values: list[Any]) -> str | None:
    """``values`` as a PostgreSQL array literal (``{"a","b",NULL}``), or None when an element is of a type this does
    not write (a list, a dict, bytes...: psycopg adapts those itself).

    Why: psycopg adapts a Python list by looking at its elements to choose the array's type, in Python, per call: 62
    µs for the eleven values of a release batch of three, 16 µs as text literals, on the threads that share the
    consumer loop's interpreter lock. Every statement of ``run`` casts its arrays (``CAST(:x AS text[])``), so the
    server parses the literal as the array it always got. Each element is quoted and its backslashes and double quotes
    escaped, so a value is read back exactly as it was (a NUL, which no text value may hold, is refused by the
    driver as before: a data error of that call)."""
    parts = []
    for value in values:
        kind = type(value)
        if value is None:
            parts.append("NULL")
        elif kind is str:
            parts.append('"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"')
        elif kind is int or kind is float:
            parts.append(repr(value))
        elif kind is bool:
            parts.append("true" if value else "false")
        elif isinstance(value, datetime) and value.tzinfo is not None:
            parts.append('"' + value.isoformat() + '"')
        elif isinstance(value, uuid.UUID):
            parts.append(str(value))
        else:
            return None
    return "{" + ",".join(parts) + "}"


def _arrays_as_literals(params: Mapping[str, Any]) -> Mapping[str, Any]:
    """``params`` with each list written as an array literal (``array_literal``) where it can be."""
    out: dict[str, Any] | None = None
    for name, value in params.items():
        if type(value) is list:
            literal = array_literal(value)
            if literal is not None:
                if out is None:
                    out = dict(params)
                out[name] = literal
    return params if out is None else out


def run(conn: sa.Connection, statement: sa.TextClause, params: Mapping[str, Any]) -> list[Any]:
    """Execute ``statement`` with ``params`` on ``conn``'s driver connection; its rows (named tuples: attribute
    access as on SQLAlchemy's rows), or [] for a statement that returns none. ``conn`` in a transaction (not in
    autocommit) runs it through SQLAlchemy instead."""
    driver = conn.connection.driver_connection
    if not isinstance(driver, psycopg.Connection) or not driver.autocommit:
        result = conn.execute(statement, params)
        return list(result) if result.returns_rows else []
    sql = driver_sql(statement)
    params = _arrays_as_literals(params)
    dispatch = conn.dispatch
    with driver.cursor(row_factory=namedtuple_row) as cursor:
        if dispatch.before_cursor_execute:
            dispatch.before_cursor_execute(conn, cursor, sql, params, None, False)
        try:
            cursor.execute(sql, params)
            rows = cursor.fetchall() if cursor.pgresult is not None and cursor.pgresult.nfields else []
        except psycopg.Error as exc:
            if driver.closed or driver.broken:
                conn.invalidate(exc)
            if data_refused(exc):
                raise as_data_error(sql, dict(params), exc) from exc
            if infrastructure_fault(exc):
                raise as_operational_error(sql, dict(params), exc) from exc
            raise sa.exc.DBAPIError.instance(
                sql, dict(params), exc, psycopg.Error, connection_invalidated=conn.invalidated
            ) from exc
        if dispatch.after_cursor_execute:
            dispatch.after_cursor_execute(conn, cursor, sql, params, None, False)
    return rows


def one(conn: sa.Connection, statement: sa.TextClause, params: Mapping[str, Any]) -> Any:
    """``run``'s only row (as SQLAlchemy's ``Result.one()``: no row or several raise)."""
    rows = run(conn, statement, params)
    if not rows:
        raise sa.exc.NoResultFound("No row was found when one was required")
    if len(rows) > 1:
        raise sa.exc.MultipleResultsFound("Multiple rows were found when exactly one was required")
    return rows[0]
