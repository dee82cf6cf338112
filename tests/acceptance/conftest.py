"""Acceptance fixtures: real Celery worker subprocesses (prefork, distinct hostnames) on a real Redis broker
and a real Postgres ledger, with an independent observer table written by the tasks themselves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kombu
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[2]

#: Seconds a test waits for the broker to hand a dead worker's unacked message to another worker. kombu 5.7's Redis
#: transport scans for them every ``unacked_restore_interval`` (1 s in proj.py); kombu 5.5 and 5.6 have no such
#: option and scan every 10th call of a 10 s timer, so up to ~100 s pass before the message comes back.
REDELIVERY_WAIT = 60.0 if tuple(int(p) for p in kombu.__version__.split(".")[:2]) >= (5, 7) else 180.0

OBSERVED = """
CREATE TABLE observed (
    id bigserial PRIMARY KEY, kind text NOT NULL, task_id text NOT NULL, key text NOT NULL,
    note text NOT NULL DEFAULT '', pid integer, at timestamptz NOT NULL, fence bigint,
    claimed_at timestamptz)
"""


@dataclass
class Cluster:
    database_url: str
    broker_url: str
    engine: sa.Engine
    env: dict[str, str]
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    tmp: Path = Path("/tmp")

    def start_worker(
        self, name: str, *, concurrency: int = 4, wait: bool = True, extra: list[str] | None = None
    ) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{name}.log"
        self.logs[name] = log
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.acceptance.proj",
            "worker",
            "-P",
            "prefork",
            "-c",
            str(concurrency),
            "-n",
            f"{name}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "INFO",
            *(extra or []),
        ]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.workers[name] = proc
        if wait:
            self.wait_ready(name)
        return proc

    def wait_ready(self, name: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.workers[name].poll() is not None:
                raise AssertionError(f"worker {name} exited:\n{self.logs[name].read_text()[-3000:]}")
            if "ready." in self.logs[name].read_text(errors="replace"):
                return
            time.sleep(0.1)
        raise AssertionError(f"worker {name} not ready:\n{self.logs[name].read_text()[-3000:]}")

    def kill_worker(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.workers[name]
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)

    def stop_all(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.workers.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def let_go(self, note: str) -> None:
        """Release the ``hold`` calls given a negative ``seconds`` and this ``note`` (they wait for this row)."""
        with self.engine.begin() as conn:
            conn.execute(
                sa.text("INSERT INTO observed (kind, task_id, key, note, at) VALUES ('go', '', '', :note, now())"),
                {"note": note},
            )

    def rows(self, sql: str, **params: Any) -> list[Any]:
        with self.engine.connect() as conn:
            return list(conn.execute(sa.text(sql), params))

    def scalar(self, sql: str, **params: Any) -> Any:
        with self.engine.connect() as conn:
            return conn.execute(sa.text(sql), params).scalar()

    def intervals(self, key: str | None = None) -> list[tuple[str, float, float]]:
        """(task_id, start, end) in seconds for every completed start/end pair, optionally of one key."""
        rows = self.rows(
            """SELECT s.task_id, extract(epoch FROM s.at) AS s, extract(epoch FROM e.at) AS e
                 FROM observed s JOIN LATERAL (
                      SELECT at FROM observed e WHERE e.task_id = s.task_id AND e.kind IN ('end', 'fail')
                         AND e.at >= s.at ORDER BY e.at LIMIT 1) e ON true
                WHERE s.kind = 'start' AND (CAST(:key AS text) IS NULL OR s.key = :key) ORDER BY s.at""",
            key=key,
        )
        return [(r.task_id, float(r.s), float(r.e)) for r in rows]

    def wait_for(
        self, sql: str, expected: Any, timeout: float = 60.0, *, at_least: bool = False, **params: Any
    ) -> None:
        """Poll ``sql`` until it returns ``expected`` (or, with ``at_least``, a count of at least ``expected``: a
        count that keeps growing can pass the value between two polls on a loaded machine)."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.scalar(sql, **params)
            if value == expected or (at_least and value is not None and value >= expected):
                return
            time.sleep(0.1)
        logs = "\n".join(f"--- {n}\n{p.read_text(errors='replace')[-4000:]}" for n, p in self.logs.items())
        raise AssertionError(f"{sql!r} = {value!r}, expected {expected!r}\n{logs}")


def peak_overlap(intervals: list[tuple[str, float, float]]) -> int:
    events = sorted([(s, 1) for _, s, _ in intervals] + [(e, -1) for _, _, e in intervals], key=lambda x: (x[0], x[1]))
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


@pytest.fixture
def cluster(database_url: str, redis_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    limits = getattr(request, "param", None) or {}
    yield from make_cluster(database_url, redis_url, tmp_path, limits)


def make_cluster(database_url: str, redis_url: str, tmp_path: Path, limits: dict[str, Any]) -> Iterator[Cluster]:
    engine = sa.create_engine(database_url, pool_pre_ping=True)
    with engine.begin() as conn:
        conn.execute(sa.text(OBSERVED))
    env = dict(os.environ)
    env.update(
        KEYED_DATABASE_URL=make_url(database_url).render_as_string(hide_password=False),
        CELERY_BROKER_URL=redis_url,
        KEYED_LIMITS=json.dumps(limits),
        PYTHONPATH=str(ROOT),
        PYTHONWARNINGS="ignore",
    )
    c = Cluster(database_url, redis_url, engine, env, tmp=tmp_path)
    try:
        yield c
    finally:
        c.stop_all()
        engine.dispose()


@pytest.fixture
def producer(cluster: Cluster) -> Iterator[Any]:
    """The acceptance app, configured in this process to publish to the cluster's broker and ledger."""
    from celery_keyed.publisher import close_publisher
    from tests.acceptance.proj import make_app

    ns = make_app(cluster.env)
    yield ns
    close_publisher(ns.app)
    ns.app.close()


@pytest.fixture
def own_postgres() -> Iterator[Any]:
    """A Postgres of this test's own, so it can be stopped without disturbing the other tests."""
    from celery_keyed.testing import PostgresServer, start_postgres

    server = start_postgres(use_env=False)
    assert isinstance(server, PostgresServer)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pg_outage_cluster(own_postgres: Any, redis_url: str, tmp_path: Path) -> Iterator[Cluster]:
    """A cluster whose ledger lives on ``own_postgres`` (migrated), so a test can stop and restart it."""
    from celery_keyed.ledger import migrate

    engine = sa.create_engine(own_postgres.url)
    migrate(engine)
    engine.dispose()
    yield from make_cluster(own_postgres.url, redis_url, tmp_path, {})

