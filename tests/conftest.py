"""Fixtures on real servers: one PostgreSQL and one Redis per test session, a fresh database per test.

- ``postgres_server`` / ``redis_server`` (session): throwaway servers from ``celery_keyed.testing``, or the
  servers named by ``KEYED_DATABASE_URL`` / ``CELERY_BROKER_URL``.
- ``database_url`` (function): a new database copied from a template that has the ledger schema (migrated once
  per session), dropped after the test.
- ``blank_database_url`` (function): a new empty database, dropped after the test (migration tests).
- ``engine`` (function): a SQLAlchemy engine on ``database_url``, disposed after the test.
- ``redis_url`` (function): a Redis database number of its own, flushed before the test (under pytest-xdist, on a
  Redis named by ``CELERY_BROKER_URL``, from this worker's share of the 16 numbers).
- ``rabbitmq_server`` (session): a throwaway RabbitMQ (Debian's rabbitmq-server; a few seconds to start), or the
  broker named by ``KEYED_AMQP_URL`` / an ``amqp://`` ``CELERY_BROKER_URL``. Skips the test when RabbitMQ is not
  installed (fails instead when ``CI`` is set: .ci/run installs it).
- ``amqp_url`` (function): a vhost of its own on ``rabbitmq_server`` (taken from a pool created in one
  ``rabbitmqctl`` call, never reused), deleted after the test. On a broker we did not start: its own URL, with the
  default ``celery`` queue purged before the test.
- ``pgbouncers`` (session): ``pgbouncers(mode, **settings)`` is a throwaway PgBouncer (Debian's pgbouncer) in
  front of ``postgres_server`` in pooling mode ``mode`` (``session`` / ``transaction``), one per mode and settings,
  started on first use. Skips the test when pgbouncer is not installed (fails instead when ``CI`` is set: .ci/run
  installs it) or when the PostgreSQL was not started by the test bed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
import sqlalchemy
from sqlalchemy.engine import make_url

from celery_keyed.testing import (
    AMQP_URL_ENV,
    BROKER_URL_ENV,
    PgBouncerServer,
    PostgresTarget,
    RabbitTarget,
    RedisTarget,
    TestbedError,
    find_pgbouncer,
    find_rabbitmq_server,
    start_pgbouncer,
    start_postgres,
    start_rabbitmq,
    start_redis,
)

REDIS_DATABASES = 16  # redis-server's default number of databases


def libpq_url(url: str) -> str:
    """The ``postgresql://`` form of a SQLAlchemy URL, for ``psycopg.connect``."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _admin(server: PostgresTarget) -> psycopg.Connection:
    """A short-lived autocommit connection for CREATE/DROP DATABASE (survives server restarts in tests)."""
    return psycopg.connect(libpq_url(server.url), autocommit=True, connect_timeout=10)


def _create_database(server: PostgresTarget, name: str, template: str | None = None) -> str:
    sql = f'CREATE DATABASE "{name}"'
    if template is not None:
        sql += f' TEMPLATE "{template}"'
    with _admin(server) as conn:
        conn.execute(sql)
    return server.url_for(name)


def _drop_database(server: PostgresTarget, name: str) -> None:
    with _admin(server) as conn:
        # WITH (FORCE) terminates the database's remaining connections first (pg_terminate_backend).
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresTarget]:
    with start_postgres() as server:
        yield server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisTarget]:
    with start_redis() as server:
        yield server


@pytest.fixture(scope="session")
def keyed_template(postgres_server: PostgresTarget) -> Iterator[str]:
    """Name of a database with the ledger schema applied, the template of every ``database_url``."""
    from celery_keyed.ledger.migrations import migrate

    name = f"keyed_template_{uuid.uuid4().hex[:8]}"
    url = _create_database(postgres_server, name)
    engine = sqlalchemy.create_engine(url)
    try:
        migrate(engine)
    finally:
        engine.dispose()  # CREATE DATABASE ... TEMPLATE needs the template to have no connections
    with _admin(postgres_server) as conn:
        conn.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
    yield name
    _drop_database(postgres_server, name)


@pytest.fixture
def database_url(postgres_server: PostgresTarget, keyed_template: str) -> Iterator[str]:
    """SQLAlchemy URL of a fresh database with the ledger schema, dropped after the test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    url = _create_database(postgres_server, name, template=keyed_template)
    yield url
    _drop_database(postgres_server, name)


@pytest.fixture
def blank_database_url(postgres_server: PostgresTarget) -> Iterator[str]:
    """SQLAlchemy URL of a fresh empty database, dropped after the test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    url = _create_database(postgres_server, name)
    yield url
    _drop_database(postgres_server, name)


@pytest.fixture
def engine(database_url: str) -> Iterator[sqlalchemy.Engine]:
    """SQLAlchemy engine on the test's own database."""
    engine = sqlalchemy.create_engine(database_url)
    yield engine
    engine.dispose()


def _xdist_share(count: int) -> range:
    """The part of ``range(count)`` this process may use on a server shared by the session's xdist workers (every
    number without xdist). Each worker starts servers of its own, so this matters only for servers named by the
    environment."""
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or workers <= 1:
        return range(count)
    return range(int(worker[2:]) % workers, count, workers)


@pytest.fixture(scope="session")
def _redis_db_numbers(redis_server: RedisTarget) -> Iterator[int]:
    """Database numbers in turn: all 16 of a throwaway Redis; of a Redis named by ``CELERY_BROKER_URL``, this xdist
    worker's share, so that parallel workers never empty each other's."""
    return itertools.cycle(range(REDIS_DATABASES) if redis_server.managed else _xdist_share(REDIS_DATABASES))


@pytest.fixture
def redis_url(redis_server: RedisTarget, _redis_db_numbers: Iterator[int]) -> str:
    """URL of an emptied Redis database; consecutive tests get different numbers (0-15, then round again)."""
    import redis

    url = redis_server.url_for(next(_redis_db_numbers))
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
    return url


AMQP_VHOST_BATCH = 32  # vhosts created per rabbitmqctl call (one call costs about as much as one vhost)


@pytest.fixture(scope="session")
def rabbitmq_server() -> Iterator[RabbitTarget]:
    broker_env = os.environ.get(BROKER_URL_ENV, "")
    if not os.environ.get(AMQP_URL_ENV) and not broker_env.startswith(("amqp", "pyamqp")):
        try:
            find_rabbitmq_server()
        except TestbedError as error:
            if os.environ.get("CI"):
                raise  # CI installs rabbitmq-server (.ci/run): a missing one must not pass as a skip
            pytest.skip(str(error))
    with start_rabbitmq() as server:
        yield server


@pytest.fixture(scope="session")
def _amqp_vhosts(rabbitmq_server: RabbitTarget) -> list[str]:
    """Vhosts created ahead, not yet handed out (refilled a batch at a time)."""
    return []


_amqp_vhost_numbers = itertools.count()


@pytest.fixture
def amqp_url(rabbitmq_server: RabbitTarget, _amqp_vhosts: list[str]) -> Iterator[str]:
    """URL of a vhost of this test's own (a fresh one, deleted after the test)."""
    if not rabbitmq_server.managed:
        from kombu import Connection

        with Connection(rabbitmq_server.url) as conn, contextlib.suppress(Exception):
            conn.default_channel.queue_purge("celery")  # NOT_FOUND when it does not exist yet
        yield rabbitmq_server.url
        return
    if not _amqp_vhosts:
        names = [f"t{next(_amqp_vhost_numbers)}_{uuid.uuid4().hex[:8]}" for _ in range(AMQP_VHOST_BATCH)]
        rabbitmq_server.add_vhosts(names)
        _amqp_vhosts.extend(names)
    vhost = _amqp_vhosts.pop(0)
    yield rabbitmq_server.url_for(vhost)
    with contextlib.suppress(TestbedError):  # a test that stopped the server for good
        rabbitmq_server.delete_vhost(vhost)


@pytest.fixture(scope="session")
def pgbouncers(postgres_server: PostgresTarget) -> Iterator[Callable[..., PgBouncerServer]]:
    """``pgbouncers(mode, **settings)``: a PgBouncer in front of ``postgres_server`` (see the module docstring)."""
    started: dict[tuple[str, tuple[tuple[str, str], ...]], PgBouncerServer] = {}

    def pgbouncer(mode: str, **settings: str) -> PgBouncerServer:
        if not postgres_server.managed:
            pytest.skip("a PgBouncer of the test bed needs a PostgreSQL the test bed started")
        try:
            find_pgbouncer()
        except TestbedError as error:
            if os.environ.get("CI"):
                raise  # CI installs pgbouncer (.ci/run): a missing one must not pass as a skip
            pytest.skip(str(error))
        key = (mode, tuple(sorted(settings.items())))
        if key not in started:
            started[key] = start_pgbouncer(postgres_server, pool_mode=mode, settings=settings)
        return started[key]

    yield pgbouncer
    for server in started.values():
        server.stop()
