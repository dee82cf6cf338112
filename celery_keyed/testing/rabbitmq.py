"""A throwaway RabbitMQ node (Debian's ``rabbitmq-server`` scripts, run as the current user with its own node
name, ports, epmd and files); ``start_rabbitmq``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import quote

from celery_keyed.testing.servers import (
    AMQP_URL_ENV,
    BROKER_URL_ENV,
    ExternalRabbit,
    RabbitTarget,
    TestbedError,
    _ManagedServer,
    _spawner,
    _tail,
    broker_from_env,
    die_with_parent,
    distinct_free_ports,
    free_port,
    launch_on_free_port,
)

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

    def ports(self) -> tuple[int, ...]:
        return (self.port, self.dist_port, self.epmd_port)

    def move_to_free_ports(self) -> None:
        self.port, self.dist_port, self.epmd_port = distinct_free_ports(3)

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
        port = str(free_port())  # the CLI's own distribution port (by default dist_port + 10000: may not exist)
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
                    preexec_fn=die_with_parent(signal.SIGKILL),
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
    external = (os.environ.get(AMQP_URL_ENV) or broker_from_env(amqp=True)) if use_env else None
    if external:
        return ExternalRabbit(external)
    scripts = find_rabbitmq_server()
    tmpdir = Path(tempfile.mkdtemp(prefix="celery-keyed-rabbitmq-"))
    try:
        server = RabbitServer(scripts, tmpdir, *distinct_free_ports(3))
        launch_on_free_port(server, timeout)
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    return server


