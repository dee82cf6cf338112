"""PostgreSQL killed (SIGKILL of the server and its backends) while real workers admit, park, run and release keyed
tasks. The test bed's PostgreSQL runs with ``synchronous_commit = off``: a commit it reported may still sit in its WAL
buffers, and a crash then discards it. The ledger commits durably whatever the server's default, so every task whose
message a worker acknowledged after a ledger commit (a parked task: the ledger then holds the only copy of its
message) is still there after the crash and runs.

(Found on a release without this: 2 of 252 tasks were acknowledged at the broker after a ledger commit the crash
discarded, and never ran.)"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from celery_keyed.testing import PostgresServer
from tests.acceptance.conftest import Cluster, peak_overlap

KEYS = [f"acct:{n}" for n in range(5)]
PER_KEY = 50


def _kill(server: PostgresServer) -> None:
    """SIGKILL the postmaster and every backend at once (its process group), as a machine's OOM killer or a crashed
    container would; its files stay, and the next start recovers from the WAL on disk."""
    proc = server._proc
    assert proc is not None and proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_postgres_killed_under_load_loses_no_task(
    pg_outage_cluster: Cluster, own_postgres: PostgresServer, producer: Any
) -> None:
    cluster = pg_outage_cluster
    cluster.env.update(KEYED_LEASE="3")
    cluster.start_worker("w1", concurrency=4)
    cluster.start_worker("w2", concurrency=4)
    results = []
    for i in range(PER_KEY):
        for key in KEYS:  # five mutexes under contention: most arrivals are parked (acknowledged after the park)
            results.append(producer.hold.delay(key, 0.02, note=str(i)))
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", 20, timeout=120, at_least=True)
    cluster.engine.dispose()
    _kill(own_postgres)
    time.sleep(1.0)
    own_postgres.resume()
    from celery.exceptions import TimeoutError as ResultTimeout

    lost = []
    deadline = time.monotonic() + 240.0  # one generous wait for all of them
    for result in results:
        try:
            result.get(timeout=max(5.0, deadline - time.monotonic()))
        except ResultTimeout:
            lost.append(result.id)
        except Exception:  # a body that met the outage itself (it writes to the database): an outcome, not a loss
            pass
    assert not lost, f"{len(lost)} of {len(results)} tasks never ended: {lost[:5]}"
    for key in KEYS:
        assert peak_overlap(cluster.intervals(key)) == 1, f"two tasks of {key} overlapped"
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome IS NOT NULL", len(results), timeout=120)

