"""The test bed's PgBouncer: a throwaway pooler in front of the test bed's PostgreSQL, in either pooling mode, with
PgBouncer's defaults (so a client that needs what a pooler does not give fails here as in production)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from celery_keyed import testing as testbed
from celery_keyed.testing import PgBouncerServer, TestbedError
from tests.conftest import libpq_url


def test_pgbouncer_passes_connections_through_and_stop_leaves_nothing(postgres_server: testbed.PostgresTarget) -> None:
    if not postgres_server.managed:
        pytest.skip("needs a PostgreSQL the test bed started")
    try:
        testbed.find_pgbouncer()
    except TestbedError as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(error))
    server = testbed.start_pgbouncer(postgres_server, pool_mode="session")
    try:
        assert server.pid is not None
        assert server.url == f"postgresql+psycopg://postgres@127.0.0.1:{server.port}/postgres"
        with psycopg.connect(libpq_url(server.url)) as conn:
            row = conn.execute("SELECT current_setting('port')", prepare=False).fetchone()
        assert row is not None and int(row[0]) == make_url(postgres_server.url).port == server.server_port
        with pytest.raises(psycopg.OperationalError, match="unsupported startup parameter: options"):
            psycopg.connect(libpq_url(server.url), options="-c statement_timeout=1000")
    finally:
        tmpdir = server.tmpdir
        server.stop()
    assert server.pid is None and not tmpdir.exists()


def test_pgbouncer_session_mode_keeps_a_client_on_its_server_connection(
    pgbouncers: Callable[..., PgBouncerServer], database_url: str
) -> None:
    url = libpq_url(pgbouncers("session").through(database_url))
    with psycopg.connect(url, autocommit=True) as conn, psycopg.connect(url, autocommit=True) as other:
        conn.execute("SET application_name = 'sticky'")
        other.execute("SELECT pg_sleep(0.05)")  # another client in between
        row = conn.execute("SHOW application_name").fetchone()
    assert row is not None and row[0] == "sticky"


def test_pgbouncer_refuses_an_unknown_pool_mode(postgres_server: testbed.PostgresTarget) -> None:
    with pytest.raises(TestbedError, match="pool_mode must be one of session, transaction"):
        PgBouncerServer(Path("/bin/true"), Path("/tmp"), 1, 2, "statement", None, {})
