"""The test bed itself, on real servers: start, stop by PID, restart, environment overrides, the CLI."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
import redis

from celery_keyed import testing as testbed
from celery_keyed.testing import PostgresServer, RedisServer, TestbedError, start_postgres, start_redis


def process_group_gone(pgid: int) -> bool:
    """True when no process is left in the group a server led (for PostgreSQL: with its backends)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def pg_query(url: str, sql: str) -> list[tuple[object, ...]]:
    conninfo = url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        cursor = conn.execute(sql)
        return cursor.fetchall() if cursor.description is not None else []


def managed_postgres(server: testbed.PostgresTarget) -> PostgresServer:
    assert isinstance(server, PostgresServer)
    return server


def managed_redis(server: testbed.RedisTarget) -> RedisServer:
    assert isinstance(server, RedisServer)
    return server


# -- PostgreSQL ----------------------------------------------------------------------------------------------


def test_postgres_starts_on_loopback_and_stop_leaves_no_process() -> None:
    server = managed_postgres(start_postgres(use_env=False))
    pid = server.pid
    assert pid is not None
    assert server.url == f"postgresql+psycopg://postgres@127.0.0.1:{server.port}/postgres"
    assert server.url_for("other").endswith(f":{server.port}/other")
    assert pg_query(server.url, "SHOW listen_addresses") == [("127.0.0.1",)]
    assert pg_query(server.url, "SHOW fsync") == [("off",)]
    assert pg_query(server.url, "SHOW max_connections") == [("200",)]

    # A client still connected must not hold up stop() (fast shutdown, not smart).
    lingering = psycopg.connect(server.conninfo)
    server.stop()
    lingering.close()

    assert server.pid is None
    assert process_group_gone(pid)
    assert not server.tmpdir.exists()
    server.stop()  # twice is fine


def test_postgres_restart_keeps_data_on_same_port() -> None:
    with start_postgres(use_env=False) as server:
        managed = managed_postgres(server)
        pg_query(server.url, "CREATE TABLE kept (x int); INSERT INTO kept VALUES (42)")
        old_pid = managed.pid
        assert old_pid is not None
        port = managed.port

        server.restart()

        assert managed.port == port
        assert managed.pid not in (None, old_pid)
        assert process_group_gone(old_pid)
        assert pg_query(server.url, "SELECT x FROM kept") == [(42,)]


def test_postgres_durable_keeps_fsync_on() -> None:
    with start_postgres(use_env=False, durable=True) as server:
        assert pg_query(server.url, "SHOW fsync") == [("on",)]
        assert pg_query(server.url, "SHOW synchronous_commit") == [("on",)]


def test_postgres_failure_reports_log_tail() -> None:
    base = Path(testbed.postgres_base_dir(durable=False) or tempfile.gettempdir())
    before = set(base.glob("celery-keyed-pg-*"))
    with pytest.raises(TestbedError, match="no_such_parameter"):
        start_postgres(use_env=False, settings={"no_such_parameter": "1"}, timeout=10)
    # its temporary directory is gone (other processes on the machine may have created theirs meanwhile)
    left = [d for d in set(base.glob("celery-keyed-pg-*")) - before if "no_such_parameter" in _log_of(d)]
    assert left == []


def _log_of(directory: Path) -> str:
    """A server directory's log, or "" when it has none (yet, or any more: another process on the machine may be
    creating or removing its own directory while this one reads)."""
    try:
        return (directory / "server.log").read_text(errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return ""


@pytest.mark.skipif(importlib.util.find_spec("pgserver") is None, reason="pgserver wheel not installed")
def test_postgres_from_embedded_wheel_binaries() -> None:
    spec = importlib.util.find_spec("pgserver")
    assert spec is not None and spec.submodule_search_locations
    bindir = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    with start_postgres(use_env=False, bindir=bindir) as server:
        (version,) = pg_query(server.url, "SHOW server_version")[0]
        assert str(version).startswith("16")


# -- Redis ---------------------------------------------------------------------------------------------------


def test_redis_start_restart_stop() -> None:
    server = managed_redis(start_redis(use_env=False))
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    client = redis.Redis.from_url(server.url_for(3))
    try:
        client.set("k", "v")
        assert client.get("k") == b"v"
        old_pid = server.pid
        assert old_pid is not None

        server.restart()

        assert server.pid not in (None, old_pid)
        assert process_group_gone(old_pid)
        assert client.get("k") is None  # no persistence: a restart is an empty broker
        assert client.ping()
    finally:
        client.close()
    pid = server.pid
    assert pid is not None
    server.stop()
    assert process_group_gone(pid)
    assert not server.tmpdir.exists()


# -- Servers named by the environment ------------------------------------------------------------------------


def test_env_override_wraps_existing_servers(
    monkeypatch: pytest.MonkeyPatch,
    postgres_server: testbed.PostgresTarget,
    redis_server: testbed.RedisTarget,
) -> None:
    monkeypatch.setenv(testbed.DATABASE_URL_ENV, postgres_server.url)
    monkeypatch.setenv(testbed.BROKER_URL_ENV, redis_server.url_for(2))

    pg = start_postgres()
    rd = start_redis()

    assert isinstance(pg, testbed.ExternalPostgres) and not pg.managed and pg.pid is None
    assert pg.url == postgres_server.url
    assert pg.url_for("x") == postgres_server.url_for("x")
    assert pg_query(pg.url, "SELECT 1") == [(1,)]
    assert isinstance(rd, testbed.ExternalRedis) and not rd.managed and rd.pid is None
    assert rd.url == redis_server.url_for(2)
    assert rd.url_for(5) == redis_server.url_for(5)
    with pytest.raises(TestbedError):
        pg.restart()

    pg.stop()
    rd.stop()
    assert pg_query(postgres_server.url, "SELECT 1") == [(1,)]  # stop() left the real server alone


def test_external_redis_url_for_keeps_credentials_and_options() -> None:
    external = testbed.ExternalRedis("redis://:secret@example.invalid:6380/0?socket_timeout=1")
    assert external.url_for(7) == "redis://:secret@example.invalid:6380/7?socket_timeout=1"


# -- python -m celery_keyed.testbed --------------------------------------------------------------------------


def test_cli_prints_exports_and_stops_servers_on_sigterm() -> None:
    env = {k: v for k, v in os.environ.items() if k not in (testbed.DATABASE_URL_ENV, testbed.BROKER_URL_ENV)}
    with subprocess.Popen(
        [sys.executable, "-m", "celery_keyed.testing"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        try:
            assert proc.stdout is not None
            lines = [proc.stdout.readline() for _ in range(3)]
            exports = dict(line.removeprefix("export ").strip().split("=", 1) for line in lines[:2])
            pids = [int(pid) for pid in re.findall(r"pid (\d+)", lines[2])]
            assert set(exports) == {testbed.DATABASE_URL_ENV, testbed.BROKER_URL_ENV}, lines
            assert pg_query(exports[testbed.DATABASE_URL_ENV], "SELECT 1") == [(1,)]
            client = redis.Redis.from_url(exports[testbed.BROKER_URL_ENV])
            assert client.ping()
            client.close()

            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert len(pids) == 2
    for pid in pids:
        assert process_group_gone(pid)
    port = int(exports[testbed.BROKER_URL_ENV].rsplit(":", 1)[1].split("/")[0])
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0


# -- Fixtures ------------------------------------------------------------------------------------------------


databases_seen: list[str] = []


def test_blank_database_url_is_fresh_and_dropped_after(
    blank_database_url: str, postgres_server: testbed.PostgresTarget
) -> None:
    dbname = blank_database_url.rsplit("/", 1)[1]
    assert pg_query(blank_database_url, "SELECT current_database()") == [(dbname,)]
    tables = pg_query(blank_database_url, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
    assert tables == [(0,)]
    databases_seen.append(dbname)


def test_previous_test_database_was_dropped(postgres_server: testbed.PostgresTarget) -> None:
    if not databases_seen:
        pytest.skip("runs after test_blank_database_url_is_fresh_and_dropped_after")
    rows = pg_query(postgres_server.url, f"SELECT 1 FROM pg_database WHERE datname = '{databases_seen[-1]}'")
    assert rows == []


def test_redis_url_is_emptied(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.dbsize() == 0
        client.set("left-behind", "1")  # the next test on this number must not see it
    finally:
        client.close()


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


@pytest.mark.skipif(
    not module_exists("celery_keyed.ledger.migrations"),
    reason="celery_keyed.ledger.migrations not written yet",
)
def test_database_url_has_the_ledger_schema(database_url: str) -> None:
    rows = pg_query(
        database_url,
        "SELECT count(*) FROM pg_tables WHERE schemaname NOT IN ('pg_catalog', 'information_schema')",
    )
    assert rows[0][0] > 0


# -- Restarts from a short-lived thread (issue 9 item 10) ------------------------------------------------------


def _restart_in_thread(action: Callable[[], None]) -> None:
    """Run ``action`` on a thread that ends right after it (as a fault injector or a test helper would)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            action()
        except BaseException as error:  # re-raised in the caller
            errors.append(error)

    thread = threading.Thread(target=run, name="short-lived")
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    if errors:
        raise errors[0]


def test_servers_restarted_from_a_short_lived_thread_stay_up() -> None:
    """The parent-death signal (PR_SET_PDEATHSIG) fires when the *thread* that forked a server exits: a
    restart, resume or start from a thread that then ends must not take the server down with it."""
    with start_postgres(use_env=False) as pg, start_redis(use_env=False) as rd:
        postgres, redis_server = managed_postgres(pg), managed_redis(rd)
        _restart_in_thread(postgres.restart)
        _restart_in_thread(redis_server.restart)
        _restart_in_thread(postgres.suspend)
        _restart_in_thread(postgres.resume)
        started: list[testbed.RedisTarget] = []
        _restart_in_thread(lambda: started.append(start_redis(use_env=False)))
        late = managed_redis(started[0])
        try:
            pids = (postgres.pid, redis_server.pid, late.pid)
            time.sleep(3.0)  # the signal is immediate when the thread ends; give it ample time anyway
            assert (postgres.pid, redis_server.pid, late.pid) == pids and None not in pids
            assert pg_query(pg.url, "SELECT 1") == [(1,)]
            for server in (redis_server, late):
                client = redis.Redis.from_url(server.url)
                try:
                    assert client.ping()
                finally:
                    client.close()
        finally:
            late.stop()


def test_persistent_redis_keeps_data_through_restart_and_outage() -> None:
    with start_redis(use_env=False, persistent=True) as rd:
        server = managed_redis(rd)
        client = redis.Redis.from_url(server.url_for(1))
        try:
            client.rpush("queue", "m1", "m2")
            server.restart()
            assert client.lrange("queue", 0, -1) == [b"m1", b"m2"]
            client.rpush("queue", "m3")
            server.suspend()
            server.resume()
            assert client.lrange("queue", 0, -1) == [b"m1", b"m2", b"m3"]
        finally:
            client.close()
