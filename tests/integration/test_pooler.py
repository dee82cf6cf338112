"""The ledger through a connection pooler (a real PgBouncer of the test bed, in session and transaction mode) and the
settings every ledger transaction runs with, whatever the connection: its statement timeout and a durable commit
(``synchronous_commit = on``; the test bed's PostgreSQL runs with it off). Also: a fault of the database or of the
pooler (a prepared statement a server connection lost) is an outage of the ledger, never a refusal of a task's data,
and migrations are serialised through a transaction pooler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_keyed.engine import create_ledger_engine
from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict, driver
from celery_keyed.ledger.books import books_balance
from celery_keyed.ledger.migrations import _MIGRATION_LOCK_ID, migrate, migration_files
from celery_keyed.settings import read_settings
from celery_keyed.testing import PgBouncerServer
from celery_keyed.worker.breaker import UNREACHABLE

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 1.5  # keyed_statement_timeout of these tests, in seconds

SETTINGS = "SELECT current_setting('statement_timeout') AS timeout, current_setting('synchronous_commit') AS sync"

#: How the ledger reaches PostgreSQL: directly, through PgBouncer in either mode, and through a PgBouncer told to
#: drop the startup options it does not know (the statement timeout silently disappeared that way).
ROUTES = ["direct", "session", "transaction", "transaction-ignoring-options"]


@pytest.fixture
def route_url(request: pytest.FixtureRequest, database_url: str, pgbouncers: Callable[..., PgBouncerServer]) -> str:
    route = request.param
    if route == "direct":
        return database_url
    if route == "transaction-ignoring-options":
        return pgbouncers("transaction", ignore_startup_parameters="options").through(database_url)
    return pgbouncers(route).through(database_url)


@pytest.fixture
def pooled_ledger(route_url: str) -> Iterator[Ledger]:
    engine = create_ledger_engine(
        read_settings({"keyed_database_url": route_url, "keyed_statement_timeout": TIMEOUT}), pinned=3
    )
    yield Ledger(engine, holder="test-host:1:pool", lease=30.0, dispatch=10.0)
    engine.dispose()


def arrival(task_id: str, key: str) -> Arrival:
    return Arrival(task_id, key=key, task_name="proj.t", message={"headers": {"id": task_id}})


@pytest.mark.parametrize("route_url", ROUTES, indirect=True)
def test_every_ledger_transaction_has_its_timeout_and_a_durable_commit(
    pooled_ledger: Ledger, engine: sa.Engine
) -> None:
    """In a transaction (``Ledger.transaction``), in autocommit through the driver (the hot path's calls) and
    through SQLAlchemy, pinned or not: the configured statement timeout, and synchronous_commit on although the
    server's default is off. (Found: through PgBouncer nothing connected — it refuses the ``options`` startup
    parameter — and with ``ignore_startup_parameters = options`` the timeout was silently gone; directly, the
    ledger's commits followed the server's default, and a crash lost tasks acknowledged after them.)"""
    ledger = pooled_ledger
    with engine.connect() as conn:  # a plain connection: the server's defaults
        assert conn.execute(sa.text(SETTINGS)).one() == ("0", "off"), "the test bed's defaults changed"
    seen = [tuple(ledger.transaction(lambda conn: conn.execute(sa.text(SETTINGS)).one()))]
    seen.append(tuple(ledger.autocommitted(lambda conn: driver.one(conn, sa.text(SETTINGS), {}))))
    seen.append(tuple(ledger.autocommitted(lambda conn: conn.execute(sa.text(SETTINGS)).one())))
    with ledger.pinned():
        for _ in range(8):  # past psycopg's prepare threshold
            seen.append(tuple(ledger.autocommitted(lambda conn: driver.one(conn, sa.text(SETTINGS), {}))))
    assert set(seen) == {(f"{round(TIMEOUT * 1000)}ms", "on")}, seen
    for run in (ledger.transaction, ledger.autocommitted):
        started = time.monotonic()
        with pytest.raises(sa.exc.OperationalError, match="statement timeout"):
            run(lambda conn: conn.execute(sa.text("SELECT pg_sleep(30)")))
        assert time.monotonic() - started < 25  # cancelled by the timeout, not by the sleep's end


@pytest.mark.parametrize("route_url", ["session", "transaction"], indirect=True)
def test_admit_park_release_and_promote_through_pgbouncer(pooled_ledger: Ledger) -> None:
    """The hot path and the general transactions through PgBouncer, from three threads at once (each with its pinned
    connection, as the worker's service threads keep them): every call answers, past psycopg's prepare threshold
    (in transaction mode a server-side prepared statement is gone with the transaction), and the books balance."""
    ledger = pooled_ledger
    ledger.configure({"gate": NameConfig("gate", limit=2)})
    errors: list[BaseException] = []

    def work(thread: int) -> None:
        try:
            with ledger.pinned():
                for i in range(12):
                    task_id = f"t{thread}-{i}"
                    admitted = ledger.admit(arrival(task_id, f"acct:{thread}"))
                    assert admitted.verdict is Verdict.ADMITTED, admitted
                    parked = ledger.admit(arrival(f"{task_id}-next", f"acct:{thread}"))
                    assert parked.verdict is Verdict.PARKED, parked
                    report = ledger.release(Token(task_id, 0), admitted.fence or 0, Outcome.COMPLETED)
                    assert report.released and [p.task_id for p in report.promotions] == [f"{task_id}-next"]
                    promoted = report.promotions[0]
                    fence = promoted.fence if promoted.nonce is None else ledger.bind(promoted.token, promoted.nonce)
                    assert fence is not None
                    assert ledger.release(promoted.token, fence, Outcome.COMPLETED).released
                gated = [ledger.admit(arrival(f"g{thread}-{i}", "gate:x")) for i in range(2)]
                assert all(a.verdict in (Verdict.ADMITTED, Verdict.PARKED) for a in gated)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive()
    assert not errors, errors
    with ledger.engine.connect() as conn:
        used = "SELECT coalesce(sum(used), 0) FROM keyed_slots WHERE key LIKE :keys"
        assert conn.execute(sa.text(used), {"keys": "acct:%"}).scalar() == 0
        assert conn.execute(sa.text(used), {"keys": "gate:x"}).scalar() == 2
        books = books_balance(conn)
    assert books["completed"] == 3 * 12 * 2, books


def test_a_lost_prepared_statement_is_an_outage_not_a_refusal(database_url: str) -> None:
    """A transaction pooler gives a client's next transaction to a server connection that does not have the
    statements psycopg prepared on another (``prepared statement "_pg3_N" does not exist``, SQLSTATE 26000). The
    same happens here on a real connection whose prepared statements are dropped behind psycopg's back. The error is
    what the worker treats as an unreachable ledger (the task is held and admitted again), not a refusal of the
    task's data. (Found: through PgBouncer in transaction mode, valid tasks were booked as rejected with a
    KeyedRejected result.)"""
    from celery_keyed.ledger.batches import REFUSED as _REFUSED

    engine = sa.create_engine(database_url, connect_args={"prepare_threshold": 0})
    ledger = Ledger(engine, holder="test-host:1:prep", lease=30.0)
    try:
        with ledger.pinned():
            assert ledger.admit(arrival("first", "acct:1")).verdict is Verdict.ADMITTED
            raw = ledger._pins.conn.connection.driver_connection
            names = [row[0] for row in raw.execute("SELECT name FROM pg_prepared_statements", prepare=False)]
            assert names, "nothing was prepared"
            for name in names:
                raw.execute(f'DEALLOCATE "{name}"', prepare=False)
            with pytest.raises(Exception) as caught:
                ledger.admit(arrival("second", "acct:2"))  # the same statement as the first: prepared before
        assert "does not exist" in str(caught.value)
        assert isinstance(caught.value, UNREACHABLE), type(caught.value)
        assert not isinstance(caught.value, _REFUSED)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT outcome FROM keyed_tasks WHERE task_id = 'second'")).all() == []
    finally:
        engine.dispose()


def _migration_lock_waiters(conn: sa.Connection) -> int:
    return int(
        conn.execute(
            sa.text("""SELECT count(*) FROM pg_locks
                    WHERE locktype = 'advisory' AND NOT granted AND database = (
                          SELECT oid FROM pg_database WHERE datname = current_database())
                      AND ((classid::bigint << 32) | objid::bigint) = :id"""),
            {"id": _MIGRATION_LOCK_ID},
        ).scalar_one()
    )


def _open_server_connections(url: str, count: int) -> None:
    """Make the pooler open ``count`` server connections (left idle for the next transactions), as a busy pooler has:
    ``count`` clients each in a transaction at the same moment."""
    import psycopg

    from tests.conftest import libpq_url

    clients = [psycopg.connect(libpq_url(url), prepare_threshold=None) for _ in range(count)]
    try:
        for client in clients:
            client.execute("SELECT 1")  # BEGIN: each holds a server connection until its rollback
        for client in clients:
            client.rollback()
    finally:
        for client in clients:
            client.close()


def test_three_concurrent_migrates_through_transaction_pooling(
    blank_database_url: str, pgbouncers: Callable[..., PgBouncerServer]
) -> None:
    """Three migrate() runs through PgBouncer in transaction mode, made to overlap (a direct connection holds the
    migration lock until all three wait for it): every run succeeds and each version is applied once. (Found: a
    session-level advisory lock through a transaction pooler serialised nothing; one run crashed with
    UniqueViolation.)"""
    # round robin: each transaction of a client on another server connection than its last, as under load
    url = pgbouncers("transaction", server_round_robin="1").through(blank_database_url)
    everything = [version for version, _ in migration_files()]
    results: list[list[str]] = []
    errors: list[BaseException] = []
    engines = [create_ledger_engine(read_settings({"keyed_database_url": url})) for _ in range(3)]

    def run(engine: sa.Engine) -> None:
        try:
            results.append(migrate(engine))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    direct = sa.create_engine(blank_database_url)
    _open_server_connections(url, 8)
    try:
        with direct.connect() as holder:
            holder.execute(sa.text("SELECT pg_advisory_lock(:id)"), {"id": _MIGRATION_LOCK_ID})
            holder.commit()
            threads = [threading.Thread(target=run, args=(engine,), daemon=True) for engine in engines]
            for t in threads:
                t.start()
            with direct.connect() as observer:
                deadline = time.monotonic() + 30
                while _migration_lock_waiters(observer) < 3:
                    assert time.monotonic() < deadline, f"the three runs never all waited for the lock: {errors}"
                    time.sleep(0.02)
            holder.execute(sa.text("SELECT pg_advisory_unlock(:id)"), {"id": _MIGRATION_LOCK_ID})
            holder.commit()
            for t in threads:
                t.join(timeout=60)
                assert not t.is_alive()
        assert not errors, errors
        assert sorted(map(tuple, results)) == [(), (), tuple(everything)]
        with direct.connect() as conn:
            rows = conn.execute(sa.text("SELECT version, count(*) FROM keyed_migrations GROUP BY version")).all()
        assert sorted(rows) == [(version, 1) for version in sorted(everything)]
    finally:
        direct.dispose()
        for engine in engines:
            engine.dispose()


def test_the_keyed_commands_through_transaction_pooling(
    blank_database_url: str, pgbouncers: Callable[..., PgBouncerServer]
) -> None:
    """``celery keyed migrate`` three times at once and ``celery keyed status``, as a user runs them, with
    ``KEYED_DATABASE_URL`` naming PgBouncer in transaction mode. (Found: every command exited 1 with
    ``unsupported startup parameter: options``; concurrent migrates were not serialised.)"""
    env = {
        **os.environ,
        "KEYED_DATABASE_URL": pgbouncers("transaction", server_round_robin="1").through(blank_database_url),
        "KEYED_LIMITS": json.dumps({"api": 2}),
        "CELERY_BROKER_URL": "memory://",
        "PYTHONPATH": str(ROOT),
        "PYTHONWARNINGS": "ignore",
    }
    celery = [sys.executable, "-m", "celery", "-A", "tests.integration.cli_app", "keyed"]
    migrates = [
        subprocess.Popen([*celery, "migrate", "--json"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]  # fmt: skip
    applied: list[Any] = []
    for proc in migrates:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        applied.append(json.loads(out)["applied"])
    everything = [version for version, _ in migration_files()]
    assert sorted(applied, key=len) == [[], [], everything]
    done = subprocess.run([*celery, "status", "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["names"] == []


def test_connect_arguments_from_the_settings_and_the_url(database_url: str) -> None:
    """``keyed_connect_args`` reach ``psycopg.connect`` (and win over the engine's own); ``?prepare_threshold=none`` in
    the URL turns psycopg's server-side prepared statements off. (Found: there was no way to pass connect arguments,
    and the URL form raised TypeError: SQLAlchemy handed psycopg the string "none".)"""
    settings = read_settings(
        {
            "keyed_database_url": f"{database_url}?prepare_threshold=none",
            "keyed_connect_args": {"application_name": "billing-workers"},
        }
    )
    engine = create_ledger_engine(settings)
    try:
        with engine.connect() as conn:
            for _ in range(8):  # past psycopg's default prepare threshold (5)
                conn.execute(sa.text("SELECT :x"), {"x": 1})
            assert conn.execute(sa.text("SELECT count(*) FROM pg_prepared_statements")).scalar() == 0
            assert conn.execute(sa.text("SHOW application_name")).scalar() == "billing-workers"
    finally:
        engine.dispose()


def test_a_worker_says_when_the_ledgers_server_is_not_crash_safe(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """No transaction can make a commit durable on a server with fsync or full_page_writes off (the test bed's
    PostgreSQL runs so): the worker's first ledger call at start says it, loudly. A durable server gets no warning."""
    from celery_keyed.testing import start_postgres

    with caplog.at_level("WARNING", logger="celery_keyed"):
        Ledger(engine, holder="test-host:1:unsafe").register_holder()
    warned = [r.getMessage() for r in caplog.records if "crash may lose" in r.getMessage()]
    assert len(warned) == 1 and "fsync=off and full_page_writes=off" in warned[0], warned
    caplog.clear()
    with start_postgres(durable=True, use_env=False) as durable:
        durable_engine = sa.create_engine(durable.url)
        try:
            migrate(durable_engine)
            with caplog.at_level("WARNING", logger="celery_keyed"):
                Ledger(durable_engine, holder="test-host:1:safe").register_holder()
        finally:
            durable_engine.dispose()
    assert not [r for r in caplog.records if "crash may lose" in r.getMessage()]
