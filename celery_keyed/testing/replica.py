"""A throwaway streaming standby of a test-bed PostgreSQL, for failover tests: the primary's copy made with
``pg_basebackup``, started on a port of its own, replicating synchronously or not, cut off from the primary's WAL
(the lag of an asynchronous standby, made as long as a test wants), and promoted. Nothing here imports Celery.

    with start_postgres() as primary, start_standby(primary, synchronous=False) as standby:
        url = multi_host_url([primary, standby], "app")      # what workers use: the writable one of the two
        standby.detach()             # stop receiving WAL: commits on the primary from now on are not on the standby
        primary.crash()              # SIGKILL the primary and its backends (files kept)
        standby.promote()            # the standby becomes the primary (a new timeline)

A synchronous standby (``synchronous_standby_names = '*'`` on the primary) makes every commit that asks for it
(``synchronous_commit`` on, or ``remote_apply``) wait until the standby has it: such a commit is never lost by a
failover. The test bed's primary runs with ``synchronous_commit=off`` unless started ``durable=True``: the ledger
asks for durability in the transactions that need it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

from celery_keyed.testing.postgres import PG_SUPERUSER, PostgresServer, postgres_base_dir
from celery_keyed.testing.servers import TestbedError, _as_user, free_port, launch_on_free_port

__all__ = ["PostgresStandby", "crash", "multi_host_url", "start_standby"]


class PostgresStandby(PostgresServer):
    """A streaming standby of a :class:`~celery_keyed.testbed.PostgresServer` (hot standby: read-only queries)."""

    kind = "PostgreSQL standby"

    def __init__(self, primary: PostgresServer, tmpdir: Path, port: int) -> None:
        super().__init__(primary.bindir, tmpdir, port, primary.owner, primary.durable, dict(primary.settings))
        self.primary = primary

    def _basebackup(self, timeout: float) -> None:
        command = [
            str(self.bindir / "pg_basebackup"),
            "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", PG_SUPERUSER,
            "-D", str(self.datadir), "-R", "-X", "stream", "--checkpoint=fast", "--no-sync",
        ]  # fmt: skip
        result = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            cwd=self.tmpdir,
            check=False,
            timeout=timeout,
            env=self._env(),
            **_as_user(self.owner),
        )
        if result.returncode != 0:
            raise TestbedError(f"pg_basebackup failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")

    def _sql(self, statement: str, *, port: int | None = None) -> list[tuple[object, ...]]:
        import psycopg

        conninfo = f"host=127.0.0.1 port={port or self.port} user={PG_SUPERUSER} dbname=postgres"
        with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
            cursor = conn.execute(statement)
            return list(cursor.fetchall()) if cursor.description else []

    @property
    def in_recovery(self) -> bool:
        """Whether this server is still a standby (not promoted)."""
        return bool(self._sql("SELECT pg_is_in_recovery()")[0][0])

    def wait_caught_up(self, timeout: float = 30.0) -> None:
        """Wait until this standby has replayed everything the primary had written when called (its WAL insert
        position: with ``synchronous_commit=off`` a commit may not even be written out yet)."""
        (lsn,) = self._sql("SELECT pg_current_wal_insert_lsn()::text", port=self.primary.port)[0]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._sql(f"SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn")[0][0]:
                return
            time.sleep(0.05)
        raise TestbedError(f"the standby on port {self.port} did not replay up to {lsn} within {timeout} s")

    def detach(self, timeout: float = 10.0) -> None:
        """Stop receiving the primary's WAL (its WAL receiver ends and does not come back): every commit on the
        primary from now on is missing here, as on an asynchronous standby that lags. Not for a synchronous
        standby, whose primary would then wait for ever on every commit that asks for it."""
        self._sql("ALTER SYSTEM SET primary_conninfo = ''")
        self._sql("SELECT pg_reload_conf()")
        deadline = time.monotonic() + timeout
        while self._sql("SELECT count(*) FROM pg_stat_wal_receiver")[0][0]:
            if time.monotonic() > deadline:
                raise TestbedError(f"the standby on port {self.port} still receives WAL after {timeout} s")
            time.sleep(0.05)

    def promote(self, timeout: float = 30.0) -> None:
        """Make this standby a primary (a new timeline); returns once it accepts writes."""
        if not self._sql(f"SELECT pg_promote(true, {max(1, round(timeout))})")[0][0]:
            raise TestbedError(f"the standby on port {self.port} was not promoted within {timeout} s")


def crash(server: PostgresServer) -> None:
    """SIGKILL a test-bed PostgreSQL and every backend of it at once (its files are kept: ``resume()`` starts it
    again, with crash recovery), as when its machine dies."""
    pid = server.pid
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # the postmaster leads its own process group: it and its backends
    server.suspend(timeout=5.0)  # reaps the process; keeps the files


def start_standby(primary: PostgresServer, *, synchronous: bool = False, timeout: float = 60.0) -> PostgresStandby:
    """Start a streaming standby of ``primary`` (a server the test bed started). ``synchronous``: the primary waits
    for it on every commit that asks for durability (``synchronous_standby_names = '*'``, set on the primary)."""
    if not isinstance(primary, PostgresServer):
        raise TestbedError("a standby needs a primary the test bed started (not one named by the environment)")
    if not (primary.bindir / "pg_basebackup").is_file():
        raise TestbedError(f"no pg_basebackup in {primary.bindir}: a standby needs Debian's postgresql package")
    tmpdir = Path(tempfile.mkdtemp(prefix="celery-keyed-pg-standby-", dir=postgres_base_dir(primary.durable)))
    try:
        if primary.owner is not None:
            os.chmod(tmpdir, 0o755)
            os.chown(tmpdir, *primary.owner)
        (tmpdir / "sock").mkdir()
        if primary.owner is not None:
            os.chown(tmpdir / "sock", *primary.owner)
        standby = PostgresStandby(primary, tmpdir, free_port())
        standby._basebackup(timeout)
        launch_on_free_port(standby, timeout)
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    names = "'*'" if synchronous else "''"
    standby._sql(f"ALTER SYSTEM SET synchronous_standby_names = {names}", port=primary.port)
    standby._sql("SELECT pg_reload_conf()", port=primary.port)
    want = "sync" if synchronous else "async"
    deadline = time.monotonic() + timeout
    while standby._sql("SELECT sync_state FROM pg_stat_replication", port=primary.port) != [(want,)]:
        if time.monotonic() > deadline:
            standby.stop()
            raise TestbedError(f"the standby on port {standby.port} did not become {want} within {timeout} s")
        time.sleep(0.05)
    standby.wait_caught_up(timeout)
    return standby


def multi_host_url(servers: list[PostgresServer], dbname: str) -> str:
    """A SQLAlchemy URL naming every server, of which libpq takes the first that accepts writes
    (``target_session_attrs=read-write``): how clients follow a failover without a proxy."""
    hosts = "&".join(f"host=127.0.0.1:{s.port}" for s in servers)
    return f"postgresql+psycopg://{PG_SUPERUSER}@/{quote(dbname)}?{hosts}&target_session_attrs=read-write"
