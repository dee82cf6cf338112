"""A body the self-fence stopped runs again, whatever the task's acks settings (D19), with real prefork workers.

The ledger's server goes away for longer than a lease while a keyed body runs; the worker's self-fence kills the
body's pool process before its lease could lapse. With Celery's defaults (``acks_late`` off) the message was acked
when the body started, and with ``acks_late`` but not ``reject_on_worker_lost`` Celery acks it when the worker is
lost: either way the task used to end there, failed with ``WorkerLostError``. It is sent back to be admitted again,
runs to completion once the ledger is back, and has one final outcome in the books."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from celery_keyed.testing import PostgresServer
from tests.acceptance.conftest import Cluster

LEASE = 3.0


def _wait_for_log(cluster: Cluster, name: str, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in cluster.logs[name].read_text(errors="replace"):
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in the log of {name}:\n{cluster.logs[name].read_text()[-4000:]}")


@pytest.mark.parametrize("task", ["long_once", "long_once_late"])
def test_a_fenced_body_runs_again_whatever_the_acks_settings(
    pg_outage_cluster: Cluster, own_postgres: PostgresServer, producer: Any, tmp_path: Path, task: str
) -> None:
    cluster = pg_outage_cluster
    cluster.env.update(KEYED_LEASE=str(LEASE))
    cluster.start_worker("w1", concurrency=2)
    log = tmp_path / "bodies.jsonl"
    result = getattr(producer, task).delay("acct:1", 300.0, str(log))
    deadline = time.monotonic() + 60
    while not (log.exists() and '"start"' in log.read_text()):
        assert time.monotonic() < deadline, "the body never started"
        time.sleep(0.05)
    cluster.engine.dispose()
    own_postgres.suspend()
    try:
        _wait_for_log(cluster, "w1", f"terminating acceptance.{task}")
    finally:
        own_postgres.resume()
    assert result.get(timeout=120) == "acct:1 run 2"
    assert result.state == "SUCCESS"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["run"] for r in records if r["kind"] == "start"] == [1, 2]
    assert [r["run"] for r in records if r["kind"] == "end"] == [2]  # the first run was stopped
    assert [r["alive"] for r in records if r["kind"] == "start"] == [[], []]
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
    cluster.wait_for("SELECT outcome FROM keyed_tasks WHERE task_id = :id", "completed", id=result.id)
    assert cluster.scalar("SELECT count(*) FROM keyed_tasks") == 1
    assert cluster.scalar("SELECT count(*) FROM keyed_waiting") == 0
