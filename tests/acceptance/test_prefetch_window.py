"""A finished keyed task's unacked message does not keep the next message from a free pool process (D15 + D3).

With ``acks_late`` the gate sends a finished task's ack only once its release has committed (D15: a crash in between
redelivers a copy the ledger drops, never an acked task whose outcome was not booked). Until then the message still
counts in the prefetch window, so a worker with one pool process and prefetch 1 would receive nothing while its
pool process idles. The gate opens the window by one while such an ack waits. Here the release of the first task is
held up by a row lock taken by the test, and a task of another key must start meanwhile, on the same single pool
process; the books balance once the lock goes."""

from __future__ import annotations

import time

import sqlalchemy as sa

from tests.acceptance.conftest import Cluster


def _started(cluster: Cluster, task_id: str) -> bool:
    return bool(cluster.scalar("SELECT count(*) FROM observed WHERE kind = 'start' AND task_id = :t", t=task_id))


def test_the_next_task_starts_while_the_release_before_it_waits(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=1)
    first = producer.hold.apply_async(("acct:a", 0.5, "first"))
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start' AND task_id = :t", 1, t=first.id)
    with cluster.engine.connect() as locker:
        transaction = locker.begin()
        # The running claim's row: its release (and the heartbeat's renewal) waits for this lock.
        locked = locker.execute(
            sa.text("SELECT task_id FROM keyed_claims WHERE task_id = :t FOR UPDATE"), {"t": first.id}
        ).all()
        assert len(locked) == 1
        cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end' AND task_id = :t", 1, t=first.id)
        second = producer.hold.apply_async(("acct:b", 0.1, "second"))
        deadline = time.monotonic() + 20
        while not _started(cluster, second.id) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _started(cluster, second.id), "the pool process idled while the first task's ack waited"
        assert cluster.scalar("SELECT count(*) FROM keyed_claims WHERE task_id = :t", t=first.id) == 1  # not yet
        transaction.rollback()
    assert first.get(timeout=30) == "first" and second.get(timeout=30) == "second"
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome = 'completed'", 2)
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
