"""What every throwaway server shares: the errors and the targets callers see (``PostgresTarget``, ...), the
process plumbing (one spawner thread, parent-death signals, free ports, the servers alive at exit), the base
class of a server we start, and the wrappers of servers named by the environment (never stopped by us)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import IO, Protocol, Self, TypedDict, TypeVar, cast
from urllib.parse import quote, urlsplit

DATABASE_URL_ENV = "KEYED_DATABASE_URL"
BROKER_URL_ENV = "CELERY_BROKER_URL"
AMQP_URL_ENV = "KEYED_AMQP_URL"  # a RabbitMQ to use when CELERY_BROKER_URL names a Redis
_AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")
_LOG_TAIL_LINES = 30


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


def live_servers() -> list[_ManagedServer]:
    """The servers this process started and has not stopped (stopped at interpreter exit if still running)."""
    with _live_lock:
        return list(_live)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def die_with_parent(sig: signal.Signals) -> Callable[[], None] | None:
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
                preexec_fn=die_with_parent(self._pdeathsig),
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

    def ports(self) -> tuple[int, ...]:
        """The ports the server listens on (``launch_on_free_port`` checks whether someone else took one)."""
        return (self.port,)

    def move_to_free_ports(self) -> None:
        """Pick other free ports before launching again."""
        self.port = free_port()

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



def distinct_free_ports(count: int) -> list[int]:
    """``count`` different free ports (each probe's socket is closed at once, so the kernel may repeat one)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports



def launch_on_free_port(server: _ManagedServer, timeout: float, attempts: int = 3) -> None:
    """Launch, picking other free ports if someone took ours between probing and binding."""
    for attempt in range(attempts):
        try:
            server._launch(timeout)
            return
        except TestbedError:
            if attempt == attempts - 1 or not any(_port_in_use(port) for port in server.ports()):
                raise
            server.move_to_free_ports()


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False



def broker_from_env(*, amqp: bool) -> str | None:
    """``CELERY_BROKER_URL`` when it names a broker of the wanted kind (RabbitMQ or Redis), else None."""
    url = os.environ.get(BROKER_URL_ENV)
    if not url:
        return None
    return url if (urlsplit(url).scheme in _AMQP_SCHEMES) == amqp else None


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

