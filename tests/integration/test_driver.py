"""``ledger.driver``: the hot path's self-committing statements run on psycopg directly. What callers and operators
relied on through SQLAlchemy must hold on this path too: the same rows, SQLAlchemy's exception classes (the breaker
and the retries catch them), a connection the server dropped invalidated (never handed out again), the cursor
events (tests and bench.ledger count round trips with them), and a connection in a transaction left to SQLAlchemy."""

from __future__ import annotations

import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger, Outcome, Token, driver, fast_paths

PROBE = sa.text(
    "SELECT CAST(:a AS integer) + 1 AS plus, CAST(:b AS text[]) AS arr, '100%' AS pct, 'x'::text AS cast_kept,"
    " CAST(:a AS text) || ':a' AS literal"
)


def test_the_placeholders_are_converted_and_nothing_else() -> None:
    sql = driver.driver_sql(PROBE)
    assert "%(a)s" in sql and "%(b)s" in sql
    assert "'100%%'" in sql  # a literal percent sign is escaped for psycopg
    assert "'x'::text" in sql  # a cast is not a placeholder
    assert driver.driver_sql(PROBE) is sql  # converted once


def test_the_same_rows_as_through_sqlalchemy(engine: sa.Engine) -> None:
    params = {"a": 41, "b": ["x", None, "z"]}
    with engine.connect() as conn:
        expected = conn.execute(PROBE, params).one()
    with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        row = driver.one(conn, PROBE, params)
    assert tuple(row) == tuple(expected)
    assert (row.plus, row.arr, row.pct, row.cast_kept) == (42, ["x", None, "z"], "100%", "x")


def test_a_refused_value_raises_sqlalchemys_exception_class(engine: sa.Engine) -> None:
    statement = sa.text("INSERT INTO keyed_tasks (task_id, task_name) VALUES (:task_id, NULL)")
    with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        try:
            driver.run(conn, statement, {"task_id": "t-null-name"})
        except sa.exc.IntegrityError as exc:  # NOT NULL: the class admit_many's isolation catches
            assert "task_name" in str(exc.orig)
        else:
            raise AssertionError("the NOT NULL constraint did not refuse the row")
        assert driver.one(conn, sa.text("SELECT 1 AS one"), {}).one == 1  # the connection is still usable


def test_a_dropped_connection_is_invalidated_and_raises_operational_error(engine: sa.Engine) -> None:
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
    with autocommit.connect() as conn:
        pid = driver.one(conn, sa.text("SELECT pg_backend_pid() AS pid"), {}).pid
        with engine.connect() as other:
            other.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        try:
            driver.run(conn, sa.text("SELECT 1 AS one"), {})
        except sa.exc.OperationalError:  # what the breaker counts as unreachable
            assert conn.invalidated
        else:
            raise AssertionError("a terminated backend answered")
    with autocommit.connect() as conn:  # the pool hands out a new connection, not the dead one
        assert driver.one(conn, sa.text("SELECT pg_backend_pid() AS pid"), {}).pid != pid


def test_the_cursor_events_see_the_statement(engine: sa.Engine) -> None:
    seen: list[str] = []
    after: list[str] = []

    def before(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        seen.append(statement)

    def done(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        after.append(statement)

    sa.event.listen(engine, "before_cursor_execute", before)
    sa.event.listen(engine, "after_cursor_execute", done)
    try:
        with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
            driver.run(conn, PROBE, {"a": 1, "b": []})
    finally:
        sa.event.remove(engine, "before_cursor_execute", before)
        sa.event.remove(engine, "after_cursor_execute", done)
    assert seen == after == [driver.driver_sql(PROBE)]


def test_a_connection_in_a_transaction_stays_with_sqlalchemy(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        driver.run(conn, sa.text("CREATE TEMP TABLE t_driver (x int) ON COMMIT DROP"), {})
        driver.run(conn, sa.text("INSERT INTO t_driver VALUES (CAST(:x AS integer))"), {"x": 7})
        assert conn.in_transaction()
        assert driver.one(conn, sa.text("SELECT x FROM t_driver"), {}).x == 7


def test_the_hot_path_runs_on_the_driver(ledger: Ledger, engine: sa.Engine) -> None:
    """A claim and its release on a key seen before: the fast statements, each once, in their driver form."""
    first = ledger.admit(Arrival(task_id="t-warm", key="acct:1"))  # the key's first use creates its slot row
    ledger.release(Token("t-warm", 0), first.fence or 0, Outcome.COMPLETED)
    seen: list[str] = []
    listener = lambda conn, cursor, statement, *rest: seen.append(statement)  # noqa: E731
    sa.event.listen(engine, "before_cursor_execute", listener)
    try:
        admission = ledger.admit(Arrival(task_id="t-driver", key="acct:1"))
        report = ledger.release(Token("t-driver", 0), admission.fence or 0, Outcome.COMPLETED)
    finally:
        sa.event.remove(engine, "before_cursor_execute", listener)
    assert admission.fence is not None and report.released
    claims = {driver.driver_sql(fast_paths.CLAIM_NEW), driver.driver_sql(fast_paths.CLAIM_NEW_WAITING)}
    assert len(seen) == 2 and seen[0] in claims, seen
    assert seen[1] == driver.driver_sql(fast_paths.RELEASE_AND_PROMOTE)


def test_a_value_over_postgresqls_own_limits_is_a_data_error_not_an_unreachable_database(
    ledger: Ledger, engine: sa.Engine
) -> None:
    """An index row over the B-tree's 2,704 bytes is SQLSTATE 54000, which psycopg raises as an OperationalError: the
    breaker would read one message's task id as the database being down (found: a foreign message with an 8,000
    character id stalled a worker's keyed intake). On both paths — the driver's and SQLAlchemy's — it is a
    ``DataError``, like any other refused value."""
    import secrets

    import pytest

    huge = "t-" + secrets.token_hex(4000)  # incompressible: TOAST cannot bring it under the limit
    with pytest.raises(sa.exc.DataError, match="index row size"):
        ledger.admit(Arrival(huge, key="acct:huge", message={"id": huge}))  # the driver (autocommit fast path)
    statement = sa.text("INSERT INTO keyed_tasks (task_id, task_name, arrived_at) VALUES (:task_id, 't', now())")
    # SQLAlchemy's own path (a transaction), on any engine a Ledger was made with (its handle_error listener)
    with pytest.raises(sa.exc.DataError, match="index row size"), engine.begin() as conn:
        conn.execute(statement, {"task_id": huge})
    assert ledger.admit(Arrival("t-fine", key="acct:huge", message={"id": "t-fine"})).verdict.value == "admitted"


def test_lists_go_as_array_literals_and_come_back_exactly(engine: sa.Engine) -> None:
    """Lists are written as array literals (``driver.array_literal``: psycopg's own adaptation of a list is most of
    a hot call's client CPU). Hostile text must come back exactly: quotes, backslashes, braces, commas, blanks, the
    word NULL, non-ASCII; ints, floats, timestamps and NULLs too. A NUL is still a data error of the call."""
    import datetime
    import uuid

    hostile = ['a"b', "c\\d", "{e,f}", " g ", "NULL", "", "h'i", "ключ:🔑", '\\"', "x\ny\tz"]
    moment = datetime.datetime(2026, 12, 6, 5, 0, 0, 123456, tzinfo=datetime.timezone(datetime.timedelta(hours=2)))
    ident = uuid.uuid4()
    probe = sa.text(
        "SELECT CAST(:t AS text[]) AS t, CAST(:i AS bigint[]) AS i, CAST(:f AS double precision[]) AS f,"
        " CAST(:d AS timestamptz[]) AS d, CAST(:u AS uuid[]) AS u, CAST(:b AS boolean[]) AS b"
    )
    params = {
        "t": [*hostile, None], "i": [0, -1, 2**62, None], "f": [0.1, -2.5e300, None], "d": [moment, None],
        "u": [ident], "b": [True, False, None],
    }
    assert driver.array_literal(params["t"]) is not None
    with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        row = driver.one(conn, probe, params)
        assert row.t == params["t"]
        assert row.i == params["i"] and row.f == params["f"] and row.u == params["u"] and row.b == params["b"]
        assert row.d == params["d"]
        try:
            driver.run(conn, sa.text("SELECT CAST(:t AS text[]) AS t"), {"t": ["nul\x00here"]})
        except sa.exc.DataError as exc:  # the class admit_many's and release_many's isolation catch
            assert "NUL" in str(exc)
        else:
            raise AssertionError("a NUL in a text array was accepted")
    # an element it does not write (a naive time, bytes) leaves the list to psycopg
    assert driver.array_literal([datetime.datetime(2026, 1, 1)]) is None
    assert driver.array_literal([b"x"]) is None
