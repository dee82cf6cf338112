"""The test bed's streaming standby (celery_keyed.testing.replica): a failover as the failover tests need it — a
standby that lags (detached) loses the primary's last commits, a synchronous one loses none, and a multi-host URL
follows the promoted server."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa

from celery_keyed.testing import PostgresServer, find_postgres_bindir, start_postgres
from celery_keyed.testing.replica import crash, multi_host_url, start_standby

pytestmark = pytest.mark.skipif(
    not (find_postgres_bindir() / "pg_basebackup").is_file(), reason="no pg_basebackup beside the test bed's postgres"
)


@pytest.fixture
def primary() -> Iterator[PostgresServer]:
    with start_postgres(use_env=False) as server:
        assert isinstance(server, PostgresServer)
        yield server


def _rows(port: int) -> list[int]:
    with psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname=postgres", connect_timeout=5) as conn:
        return [r[0] for r in conn.execute("SELECT n FROM t ORDER BY n")]


def _insert(port: int, n: int, *, durable: bool = False) -> None:
    conninfo = f"host=127.0.0.1 port={port} user=postgres dbname=postgres"
    with psycopg.connect(conninfo, connect_timeout=5) as conn:
        if durable:
            conn.execute("SET LOCAL synchronous_commit = on")
        conn.execute("INSERT INTO t VALUES (%s)", (n,))


def test_a_detached_standby_promoted_after_a_crash_has_lost_the_primarys_last_commits(primary: PostgresServer) -> None:
    with psycopg.connect(primary.conninfo, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (n int)")
    _insert(primary.port, 1)
    with start_standby(primary) as standby:
        assert standby.in_recovery
        with psycopg.connect(primary.conninfo, autocommit=True) as conn:
            assert conn.execute("SELECT sync_state FROM pg_stat_replication").fetchall() == [("async",)]
        standby.detach()  # from now on the standby lags
        _insert(primary.port, 2, durable=True)
        crash(primary)
        assert primary.pid is None
        standby.promote()
        assert not standby.in_recovery
        assert _rows(standby.port) == [1]  # 2 committed on the primary only: lost with it
        # the URL workers use finds the promoted server, the dead primary first in its list
        engine = sa.create_engine(multi_host_url([primary, standby], "postgres"))
        try:
            with engine.connect() as conn:
                assert conn.scalar(sa.text("SELECT current_setting('port')::int")) == standby.port
                assert conn.scalar(sa.text("SELECT count(*) FROM t")) == 1
        finally:
            engine.dispose()


def test_a_synchronous_standby_has_every_commit_that_asked_for_it(primary: PostgresServer) -> None:
    with psycopg.connect(primary.conninfo, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (n int)")
    with start_standby(primary, synchronous=True) as standby:
        with psycopg.connect(primary.conninfo, autocommit=True) as conn:
            assert conn.execute("SELECT sync_state FROM pg_stat_replication").fetchall() == [("sync",)]
        for n in range(1, 21):
            _insert(primary.port, n, durable=True)  # returns once the standby has it
        crash(primary)
        standby.promote()
        assert _rows(standby.port) == list(range(1, 21))


def test_the_crashed_primary_comes_back_with_its_files(primary: PostgresServer) -> None:
    with psycopg.connect(primary.conninfo, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (n int)")
    _insert(primary.port, 1, durable=True)
    crash(primary)
    primary.resume()
    assert _rows(primary.port) == [1]
