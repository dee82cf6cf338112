"""The demo (``python -m example_project.demo``, what ``make demo`` runs) as a user runs it: a subprocess that
starts its own workers, here against the test session's servers (it makes a database of its own on them)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from celery_keyed.testbed import PostgresTarget
from tests.conftest import libpq_url

ROOT = Path(__file__).resolve().parents[2]


def demo_env(postgres_server: PostgresTarget, redis_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(KEYED_DATABASE_URL=postgres_server.url, CELERY_BROKER_URL=redis_url, PYTHONWARNINGS="ignore")
    env.pop("KEYED_LIMITS", None)
    return env


def gone(pid: int) -> bool:
    """The worker and every process of its group (its pool processes) have exited."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(entry.name) == pid or os.getpgid(int(entry.name)) == pid:
                    return False
            except ProcessLookupError:
                continue
    return True


def database_exists(postgres_server: PostgresTarget, name: str) -> bool:
    with psycopg.connect(libpq_url(postgres_server.url), autocommit=True) as conn:
        return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None


def worker_pids(text: str) -> list[int]:
    return [int(p) for p in re.findall(r"demo\d pid (\d+)", text)]


@pytest.mark.timeout(120)
def test_demo_runs_every_expectation_holds_and_leaves_nothing(
    postgres_server: PostgresTarget, redis_url: str, tmp_path: Path
) -> None:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "example_project.demo", "--unit", "0.25"],
        cwd=ROOT,
        env=demo_env(postgres_server, redis_url),
        capture_output=True,
        text=True,
        timeout=100,
    )
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"
    # the timeline of both phases, the books, the verdicts
    assert out.count("task") >= 2 and "worker  start" in out
    assert re.search(r"^\s+[A-H]\s+research:topic\s+demo[12]\s+\d", out, re.M)
    assert re.search(r"^\s+acct1 #1\s+account:1\s+demo[12]", out, re.M)
    assert "rejected at" in out and "expired at" in out
    assert "== books ==" in out and "Ledger.books(): {'arrivals': 42, 'completed': 38, 'expired': 1" in out
    assert "max in flight for research:topic = 2 (limit 2)" in out
    assert "✗" not in out and re.search(r"(\d+)/\1 expectations held", out)
    # progress went to stderr
    assert "[1 research]" in err and "8/8 finished" in err and "34/34 finished" in err
    # nothing left behind: the workers and the demo's own database
    pids = worker_pids(out)
    assert len(pids) == 2
    assert all(gone(pid) for pid in pids)
    name = re.search(r"database (keyed_demo_\w+)", err)
    assert name is not None
    assert not database_exists(postgres_server, name.group(1))
    assert time.monotonic() - started < 60


@pytest.mark.timeout(120)
def test_demo_stops_everything_on_sigterm(postgres_server: PostgresTarget, redis_url: str, tmp_path: Path) -> None:
    out_path = tmp_path / "stdout"
    with (
        open(out_path, "w") as out,
        subprocess.Popen(
            [sys.executable, "-m", "example_project.demo", "--unit", "0.5"],
            cwd=ROOT,
            env=demo_env(postgres_server, redis_url),
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
        ) as proc,
    ):
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # wait until the first phase is running: workers up, tasks in flight
            seen.append(line)
            if "[1 research]" in line and "in flight: research:topic=2" in line:
                break
        else:
            raise AssertionError("the demo ended before its first phase ran:\n" + "".join(seen))
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        status = proc.wait(timeout=30)
    err = "".join(seen) + rest
    assert status == 130, err
    assert "interrupted (SIGTERM)" in err
    pids = worker_pids(err)
    assert len(pids) == 2
    assert all(gone(pid) for pid in pids), "a worker outlived the demo"
    name = re.search(r"database (keyed_demo_\w+)", err)
    assert name is not None
    assert not database_exists(postgres_server, name.group(1))
