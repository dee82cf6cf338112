"""A throwaway PgBouncer in front of a test-bed PostgreSQL, in session or transaction pooling mode."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from celery_keyed.testing.postgres import PG_SUPERUSER, _ensure_os_user, _grant_traversal
from celery_keyed.testing.servers import PostgresTarget, TestbedError, _ManagedServer, free_port, launch_on_free_port

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
        server = PgBouncerServer(binary, tmpdir, free_port(), server_port, pool_mode, owner, dict(settings or {}))
        launch_on_free_port(server, timeout)
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    return server


