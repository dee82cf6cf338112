"""A worker cut off from PostgreSQL by a silent network (no refusal, no reset), with real prefork workers (D19).

One worker reaches the ledger through ``SilentProxy``; another reaches it directly. When the proxy goes silent, the
cut-off worker's renewals block in recv and never return. Its self-fence must still stop the body it runs before the
lease could be reclaimed elsewhere, so that the key's next task, started by the other worker once the lease lapsed,
never runs beside it; and the body it stopped must run again later (acks_late off: Celery's defaults), with one
final outcome in the books.

The bodies write their own record to a file (``acceptance.long_once``): the cut-off worker's processes cannot be
relied on to reach the database."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from celery_keyed.partition import SilentProxy
from tests.acceptance.conftest import Cluster

LEASE = 6.0  # heartbeat and self-fence margin 1 s each


def _records(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _wait_for_record(log: Path, timeout: float = 60.0, **match: Any) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in _records(log):
            if all(r.get(k) == v for k, v in match.items()):
                return r
        time.sleep(0.05)
    raise AssertionError(f"no record {match} in {log}:\n{log.read_text() if log.exists() else ''}")


def test_a_silent_partition_fences_the_body_before_its_lease_can_be_reclaimed(
    cluster: Cluster, producer: Any, tmp_path: Path
) -> None:
    pg = make_url(cluster.database_url)
    assert pg.host and pg.port
    log = tmp_path / "bodies.jsonl"
    cluster.env.update(KEYED_LEASE=str(LEASE))
    with SilentProxy(pg.host, pg.port, lifetime=300.0) as proxy:
        direct_env = dict(cluster.env)
        cluster.env["KEYED_DATABASE_URL"] = proxy.url_for(direct_env["KEYED_DATABASE_URL"])
        # No client-side timeout may rescue it: a connection opened during the partition waits as long as one
        # opened before (a short connect_timeout would fail it, and the heartbeat would see an error by luck).
        cluster.env["KEYED_CONNECT_TIMEOUT"] = "600"
        cluster.start_worker("cut", concurrency=2)
        cluster.env = direct_env
        first = producer.long_once.delay("acct:cut", 300.0, str(log))
        _wait_for_record(log, id=first.id, kind="start")
        cluster.start_worker("direct", concurrency=2, extra=["-Q", "celery,direct"])

        proxy.silence()  # the partition: the cut-off worker's ledger calls wait for ever
        second = producer.long_once.apply_async(("acct:cut", 0.5, str(log)), queue="direct")
        assert second.get(timeout=120) == "acct:cut run 1"

        records = _records(log)
        first_run = [r for r in records if r["id"] == first.id and r["run"] == 1]
        assert not [r for r in first_run if r["kind"] == "end"], "the first body ran to its end: it was not fenced"
        (second_start,) = [r for r in records if r["id"] == second.id and r["kind"] == "start"]
        assert second_start["alive"] == [], f"the next task of the key started beside a running body: {second_start}"
        last_stamp = max(r["at"] for r in first_run)
        assert second_start["at"] > last_stamp
        assert "terminating acceptance.long_once" in cluster.logs["cut"].read_text()
        # Fenced before the lease could be reclaimed: the other worker's reaper took the lapsed claim after the body's
        # last sign of life (same machine, same clock).
        reclaimed = cluster.rows(
            "SELECT extract(epoch FROM at) AS at FROM keyed_events WHERE kind = 'reclaimed' AND task_id = :id",
            id=first.id,
        )
        assert len(reclaimed) == 1 and float(reclaimed[0].at) > last_stamp

        # Item 5: the stopped body did nothing wrong; with acks_late off its message was acked at its start, and it
        # still runs again, to completion, once it can be admitted.
        proxy.heal()
        assert first.get(timeout=120) == "acct:cut run 2"
        assert first.state == "SUCCESS"
        (again,) = [r for r in _records(log) if r["id"] == first.id and r["kind"] == "start" and r["run"] == 2]
        assert again["alive"] == []
        # The books: one final outcome each (the stopped run was "worker lost", which is not one), nothing held.
        cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome = 'completed'", 2)
        cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
        assert cluster.scalar("SELECT count(*) FROM keyed_tasks WHERE outcome IS NULL") == 0
        assert cluster.scalar("SELECT count(*) FROM keyed_tasks") == 2
        assert cluster.scalar("SELECT count(*) FROM keyed_waiting") == 0
