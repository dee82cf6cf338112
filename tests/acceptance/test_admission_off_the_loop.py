"""Admission off the consumer loop (issue 13): a prefork worker decides keyed admissions on a thread of its own
(celery_keyed/worker/admission.py), so its consumer loop goes on receiving and starting work while PostgreSQL is
slow. The tests make the ledger wait on purpose: the test process holds a lock every admission needs (an
exclusive lock on the books table, ``keyed_tasks``) until it has seen what it wants, so nothing here depends on
timing; with admission on the loop (``keyed_admission_batch = 0``) the first test would not pass."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa

from tests.acceptance.conftest import Cluster


@contextmanager
def admissions_blocked(cluster: Cluster) -> Iterator[sa.Connection]:
    """Hold a lock that every admission waits for (new arrivals are written to ``keyed_tasks``)."""
    engine = sa.create_engine(cluster.database_url)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("BEGIN"))
            conn.execute(sa.text("LOCK TABLE keyed_tasks IN EXCLUSIVE MODE"))
            try:
                yield conn
            finally:
                conn.execute(sa.text("ROLLBACK"))
    finally:
        engine.dispose()


def wait_until(check: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def admission_waiting(cluster: Cluster) -> bool:
    """A worker's ledger statement waits on our lock (its admission is being decided)."""
    return waiting_statements(cluster) >= 1


def waiting_statements(cluster: Cluster) -> int:
    return int(cluster.scalar("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"))


@pytest.fixture
def slow_ledger_cluster(cluster: Cluster) -> Cluster:
    # A statement may wait on the test's lock as long as the test holds it (no timeout, no breaker).
    cluster.env["KEYED_STATEMENT_TIMEOUT"] = "120"
    return cluster


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_the_consumer_loop_does_not_wait_for_admission(slow_ledger_cluster: Cluster, producer: Any) -> None:
    cluster = slow_ledger_cluster
    cluster.start_worker("w1", concurrency=2)
    with admissions_blocked(cluster):
        keyed = producer.hold.delay("account:slow", 0.01, note="done")
        wait_until(lambda: admission_waiting(cluster), "the keyed task's admission to wait on the lock")
        unkeyed = producer.unkeyed.delay("meanwhile")
        # Received, started and finished by the same worker while its keyed admission still waits on PostgreSQL.
        assert unkeyed.get(timeout=60) == "meanwhile"
        assert cluster.scalar("SELECT count(*) FROM observed WHERE task_id = :id", id=keyed.id) == 0
    assert keyed.get(timeout=60) == "done"
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
    assert cluster.scalar("SELECT outcome FROM keyed_tasks WHERE task_id = :id", id=keyed.id) == "completed"


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_a_task_revoked_while_its_admission_is_decided_does_not_run(
    slow_ledger_cluster: Cluster, producer: Any
) -> None:
    cluster = slow_ledger_cluster
    cluster.start_worker("w1", concurrency=2)
    with admissions_blocked(cluster):
        keyed = producer.hold.delay("account:revoked", 0.01, note="done")
        wait_until(lambda: admission_waiting(cluster), "the keyed task's admission to wait on the lock")
        producer.app.control.revoke(keyed.id)  # Celery's own revoke, as a user sends it
        # The worker's revoke command stores the revoke in the ledger (on the loop, before Celery's handler adds
        # it to the worker's revoked set): it waits on the lock too. Whichever of the two commits first, the
        # task must not run and its slot must not leak.
        wait_until(lambda: waiting_statements(cluster) >= 2, "the revoke to reach the worker")
    cluster.wait_for("SELECT outcome FROM keyed_tasks WHERE task_id = :id", "revoked", id=keyed.id)
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
    assert cluster.scalar("SELECT coalesce(sum(used), 0) FROM keyed_slots") == 0
    # The key is free for the next task at once (the revoked one's slot was given back, not leaked).
    after = producer.hold.delay("account:revoked", 0.01, note="done")
    assert after.get(timeout=60) == "done"
    assert cluster.scalar("SELECT count(*) FROM observed WHERE task_id = :id", id=keyed.id) == 0


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_arrivals_decided_together_keep_the_bound_and_the_order(slow_ledger_cluster: Cluster, producer: Any) -> None:
    """Many arrivals wait on the lock, then are decided in batches: a mutex key still runs one at a time, in
    the order its tasks reached the worker, and distinct keys all run."""
    cluster = slow_ledger_cluster
    cluster.start_worker("w1", concurrency=4)
    with admissions_blocked(cluster):
        ordered = [producer.hold.delay("account:batch", 0.05, note=str(i)) for i in range(6)]
        others = [producer.hold.delay(f"account:other-{i}", 0.01, note="other") for i in range(6)]
        wait_until(lambda: admission_waiting(cluster), "the admissions to wait on the lock")
        time.sleep(0.5)  # let more of them reach the worker (not needed for correctness)
    assert [r.get(timeout=90) for r in ordered] == [str(i) for i in range(6)]
    assert [r.get(timeout=90) for r in others] == ["other"] * 6
    intervals = cluster.intervals("account:batch")
    assert len(intervals) == 6
    for (_, _, end), (_, start, _) in itertools.pairwise(intervals):
        assert start >= end, "two tasks of the mutex key overlapped"
    notes = [
        r.note
        for r in cluster.rows("SELECT note FROM observed WHERE kind = 'start' AND key = 'account:batch' ORDER BY at")
    ]
    assert notes == [str(i) for i in range(6)], f"the mutex key's tasks ran out of order: {notes}"
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
