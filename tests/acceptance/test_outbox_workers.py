"""The outbox with real workers (issue 14 item 8): a keyed message registered at publish that the broker loses —
published to Redis, then taken off the list before any worker sees it, as kombu's Redis transport loses a message
a worker pops just before it is killed — is published again from the ledger's copy by a worker's sweep and runs
exactly once; a copy published again while the first was only late is dropped as a duplicate (D8). The books
balance: one task id, one outcome."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis

from celery_keyed.ledger import Ledger
from celery_keyed.publisher import relay_outbox
from tests.acceptance.conftest import Cluster

#: Seconds a registered message may take to arrive before it is published again (producer and workers).
ARRIVAL = 2.0


@pytest.fixture
def outbox_cluster(cluster: Cluster) -> Cluster:
    cluster.env["KEYED_SEND_ARRIVAL_TIMEOUT"] = str(ARRIVAL)
    return cluster


@pytest.fixture
def broker(outbox_cluster: Cluster):
    client = redis.Redis.from_url(outbox_cluster.broker_url)
    yield client
    client.close()


def _starts(cluster: Cluster, task_id: str) -> int:
    return int(cluster.scalar("SELECT count(*) FROM observed WHERE kind = 'start' AND task_id = :t", t=task_id))


def test_a_message_the_broker_lost_is_republished_and_runs_once(outbox_cluster: Cluster, broker, producer) -> None:
    cluster = outbox_cluster
    result = producer.hold.apply_async(("acct:1", 0.1, "lost"), keyed_register_at_publish=True)
    assert broker.llen("celery") == 1
    assert broker.delete("celery") == 1  # lost before any worker saw it: the ledger never heard of the task
    assert cluster.scalar("SELECT count(*) FROM keyed_tasks") == 0
    told = Ledger(cluster.engine).explain(result.id)
    assert told.state == "outbox" and "not received by a worker yet, republished 0 times" in told.text
    cluster.start_worker("w1", concurrency=2)
    assert result.get(timeout=30) == "lost"
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome = 'completed'", 1)
    assert cluster.scalar("SELECT count(*) FROM keyed_outbox") == 0  # received: the copy is gone
    time.sleep(2 * ARRIVAL)  # nothing is published again once it arrived
    assert _starts(cluster, result.id) == 1 and broker.llen("celery") == 0
    assert dict(cluster.rows("SELECT outcome, count(*) FROM keyed_tasks GROUP BY outcome")) == {"completed": 1}
    log = cluster.logs["w1"].read_text()
    assert f"{result.id} (acceptance.hold) was not received by any worker in time" in log


def test_a_late_copy_and_its_republished_twin_run_once(outbox_cluster: Cluster, broker, producer) -> None:
    """No worker yet: the first copy waits in Redis past its arrival timeout, so the relay (here beat's, called in
    this process) publishes it again; when a worker comes, one copy runs and the other is dropped (D8)."""
    cluster = outbox_cluster
    result = producer.hold.apply_async(("acct:2", 0.5, "late"), keyed_register_at_publish=True)
    time.sleep(ARRIVAL + 0.5)
    ledger = Ledger(cluster.engine)
    assert relay_outbox(producer.app, ledger, arrival_timeout=ARRIVAL)["republished"] == 1
    assert broker.llen("celery") == 2
    cluster.start_worker("w1", concurrency=2)
    assert result.get(timeout=30) == "late"
    cluster.wait_for("SELECT duplicates FROM keyed_tasks WHERE task_id = :t", 1, t=result.id)
    cluster.wait_for("SELECT count(*) FROM keyed_waiting", 0)  # a shadow, if it was one, is dropped
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome = 'completed'", 1)
    assert _starts(cluster, result.id) == 1
    assert cluster.scalar("SELECT count(*) FROM keyed_outbox") == 0
    assert dict(cluster.rows("SELECT outcome, count(*) FROM keyed_tasks GROUP BY outcome")) == {"completed": 1}


@pytest.mark.parametrize("registered", [True, False], ids=["outbox", "no-outbox"])
def test_a_message_popped_by_a_worker_killed_mid_pop(
    outbox_cluster: Cluster, broker, producer, registered: bool
) -> None:
    """A real worker process dies right after its BRPOP took the message off the list and before kombu recorded
    it as unacked (tests/acceptance/midpop.py): the broker holds no copy any more. Registered at publish, the
    message is published again from the ledger's copy and runs exactly once; without the outbox it is lost —
    the control that shows the fault really loses it."""
    cluster = outbox_cluster
    prefix = f"midpop-{registered}-"
    result = producer.hold.apply_async(
        ("acct:3", 0.1, "mid-pop"), task_id=f"{prefix}{uuid.uuid4().hex[:8]}", keyed_register_at_publish=registered
    )
    cluster.env["KEYED_TEST_DIE_AFTER_POP"] = prefix
    try:
        dying = cluster.start_worker("w1", concurrency=2, wait=False)
        assert dying.wait(timeout=60) == 9, cluster.logs["w1"].read_text()[-3000:]
    finally:
        del cluster.env["KEYED_TEST_DIE_AFTER_POP"]
    assert broker.llen("celery") == 0
    assert not any(result.id in str(value) for value in broker.hvals("unacked"))  # lost for the broker
    assert cluster.scalar("SELECT count(*) FROM keyed_tasks") == 0  # and the gate never saw it
    cluster.start_worker("w2", concurrency=2)
    if registered:
        assert result.get(timeout=30) == "mid-pop"
        cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome = 'completed'", 1)
        assert _starts(cluster, result.id) == 1
        assert cluster.scalar("SELECT count(*) FROM keyed_outbox") == 0
        assert dict(cluster.rows("SELECT outcome, count(*) FROM keyed_tasks GROUP BY outcome")) == {"completed": 1}
    else:
        time.sleep(3 * ARRIVAL)  # longer than an outbox copy would have waited
        assert _starts(cluster, result.id) == 0
        assert cluster.scalar("SELECT count(*) FROM keyed_tasks") == 0


@pytest.mark.parametrize("registered", [True, False], ids=["outbox", "no-outbox"])
def test_a_retry_the_broker_lost(outbox_cluster: Cluster, producer, registered: bool) -> None:
    """A task's first attempt publishes its retry, which the broker then loses (taken off the Redis list before any
    worker saw it). With the outbox on for its name, the retry was registered by its attempt and a worker's sweep
    publishes it again: the task completes, each attempt ran once. Without it, the task stays between attempts —
    the control that shows the retry really is lost — and reconcile reports it once it is overdue."""
    cluster = outbox_cluster
    cluster.env["KEYED_LIMITS"] = json.dumps({"retrylost": {"limit": 1, "register_at_publish": registered}})
    cluster.start_worker("w1", concurrency=1)
    result = producer.retry_lost.apply_async(("retrylost:1",))
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind IN ('dropped', 'missed') AND task_id = :t", 1,
                     t=result.id)
    assert cluster.scalar("SELECT kind FROM observed WHERE kind IN ('dropped', 'missed') AND task_id = :t",
                          t=result.id) == "dropped"
    if registered:
        assert result.get(timeout=60) == "done"
        cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome = 'completed'", 1)
        notes = cluster.rows("SELECT note FROM observed WHERE kind = 'start' AND task_id = :t ORDER BY at", t=result.id)
        assert [n for (n,) in notes] == ["0", "1"]
        cluster.wait_for("SELECT count(*) FROM keyed_outbox", 0)
        assert f"{result.id} (acceptance.retry_lost) was not received by any worker in time" in (
            cluster.logs["w1"].read_text()
        )
    else:
        ledger = Ledger(cluster.engine)
        deadline = time.monotonic() + 60
        while ledger.reconcile().retries_missing == 0:  # overdue after the countdown + the arrival timeout
            assert time.monotonic() < deadline, "reconcile never reported the lost retry"
            time.sleep(0.5)
        assert _starts(cluster, result.id) == 1
        assert ledger.explain(result.id).state == "between_attempts"
        assert cluster.scalar("SELECT count(*) FROM keyed_events WHERE kind = 'retry_missing' AND task_id = :t",
                              t=result.id) == 1
