"""The bound and the books through ordinary faults, with real prefork workers (issue 9): a warm shutdown mid-task
(a deploy), a broker outage longer than the lease, a locally handed-off promotion behind a busy pool, null key
headers, poison messages, and an acked task whose release could not commit before its worker died.

Each test checks the task bodies' own record (the ``observed`` table), not the ledger's books, for overlaps."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_keyed import KeyedRejected
from celery_keyed.testing import PostgresServer, RedisServer, start_redis
from tests.acceptance.conftest import Cluster, make_cluster, peak_overlap

LEASE = 3.0  # heartbeat every 0.5 s; a lapsed lease is reclaimed by the other worker's reaper within ~1 s


def _interval(cluster: Cluster, task_id: str) -> tuple[float, float]:
    spans = [(s, e) for t, s, e in cluster.intervals() if t == task_id]
    assert len(spans) == 1, f"{task_id} ran {len(spans)} times: {spans}"
    return spans[0]


def _books(cluster: Cluster, task_id: str, timeout: float = 30.0) -> str | None:
    """The task's outcome in the books, once written: a result is stored by the pool process before the worker's
    releaser records the outcome, so a result in hand does not mean the books are written yet (on a loaded machine
    the gap was long enough for an immediate read to see none). None if no outcome came within ``timeout``."""
    deadline = time.monotonic() + timeout
    while (outcome := cluster.scalar("SELECT outcome FROM keyed_tasks WHERE task_id = :id", id=task_id)) is None:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return outcome


def test_warm_shutdown_mid_task_keeps_the_slot_and_hands_the_line_on(cluster: Cluster, producer) -> None:
    """A deploy: SIGTERM a worker while its keyed task runs for several leases. Celery lets the task finish; its
    slot must stay held (the heartbeat goes on after the consumer stopped, D13), and the task parked behind it
    must start on another worker once it ends — not be handed to the worker that is shutting down (item 6)."""
    cluster.env.update(KEYED_LEASE=str(LEASE))
    w1 = cluster.start_worker("w1", concurrency=2)
    first = producer.hold.delay("acct:deploy", 4 * LEASE, note="first")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start'", 1)
    second = producer.hold.delay("acct:deploy", 0.1, note="second")  # parked by w1 behind the first
    cluster.wait_for("SELECT count(*) FROM keyed_waiting", 1)
    cluster.start_worker("w2", concurrency=2)

    os.kill(w1.pid, signal.SIGTERM)  # warm shutdown of the main process only: the pool finishes the task
    assert first.get(timeout=60) == "first"
    assert second.get(timeout=60) == "second"
    w1.wait(timeout=30)

    first_span, second_span = _interval(cluster, first.id), _interval(cluster, second.id)
    assert second_span[0] >= first_span[1], f"the second started at {second_span[0]} while the first ran {first_span}"
    assert peak_overlap(cluster.intervals("acct:deploy")) == 1
    assert "celery-keyed: terminating" not in cluster.logs["w1"].read_text()  # no self-fencing of the first
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
    assert (_books(cluster, first.id), _books(cluster, second.id)) == ("completed", "completed")


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis of this test's own (persistent, like a production broker), so it can be stopped."""
    server = start_redis(use_env=False, persistent=True)
    assert isinstance(server, RedisServer)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def outage_cluster(database_url: str, own_redis: RedisServer, tmp_path: Path) -> Iterator[Cluster]:
    yield from make_cluster(database_url, own_redis.url_for(0), tmp_path, {})


@pytest.fixture
def outage_producer(outage_cluster: Cluster) -> Iterator[Any]:
    yield from _producer_for(outage_cluster)


def _producer_for(cluster: Cluster) -> Iterator[Any]:
    from celery_keyed.publisher import close_publisher
    from tests.acceptance.proj import make_app

    ns = make_app(cluster.env)
    yield ns
    close_publisher(ns.app)
    ns.app.close()


# Stopping Redis under the test process's own clients leaves their sockets to be collected later: not a finding.
@pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_broker_outage_longer_than_the_lease_keeps_the_slot(
    outage_cluster: Cluster, own_redis: RedisServer, outage_producer: Any
) -> None:
    """Redis stopped for two leases while a keyed task runs: the consumers restart, but the heartbeat goes on
    (D13), so no other worker's reaper reclaims the slot; the running task's redelivered copy is a duplicate."""
    cluster, producer = outage_cluster, outage_producer
    cluster.env.update(KEYED_LEASE=str(LEASE))
    cluster.start_worker("w1", concurrency=2)
    cluster.start_worker("w2", concurrency=2)
    first = producer.hold.delay("acct:outage", 5 * LEASE, note="first")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start'", 1)
    second = producer.hold.delay("acct:outage", 0.1, note="second")
    cluster.wait_for("SELECT count(*) FROM keyed_waiting", 1)

    own_redis.suspend()
    time.sleep(2.5 * LEASE)
    own_redis.resume()

    assert first.get(timeout=90) == "first"
    assert second.get(timeout=90) == "second"
    first_span, second_span = _interval(cluster, first.id), _interval(cluster, second.id)
    assert second_span[0] >= first_span[1], f"the second started at {second_span[0]} while the first ran {first_span}"
    assert peak_overlap(cluster.intervals("acct:outage")) == 1
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
    assert (_books(cluster, first.id), _books(cluster, second.id)) == ("completed", "completed")


def test_a_local_handoff_does_not_wait_behind_a_busy_pool(cluster: Cluster, producer) -> None:
    """W1 has one pool process and prefetches two: A (acct:x) runs, C (acct:y, long) waits in its memory; B
    is parked through W2. When A ends, W1's pool is taken by C: B must not be bound to W1 (it would hold the
    slot while W2 idles, then start with a stale claim); it runs on W2 while C still runs (D14)."""
    cluster.env.update(KEYED_LEASE=str(LEASE))
    # W2 is up from the start but consumes nothing until C waits in W1's memory (a worker's start took 6 s on a
    # loaded machine: A ended before B was parked).
    cluster.start_worker("w2", concurrency=2)
    queue = producer.app.conf.task_default_queue
    w2 = f"w2@{socket.gethostname()}"
    assert producer.app.control.cancel_consumer(queue, destination=[w2], reply=True, timeout=10), "W2 did not answer"
    cluster.start_worker("w1", concurrency=1, extra=["--prefetch-multiplier", "2"])
    a = producer.hold.delay("acct:x", 4.0, note="A")  # long enough for B to be parked on a loaded machine
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start'", 1)
    c = producer.hold.delay("acct:y", 4 * LEASE, note="C")  # outlasts B on W2 and a lease
    received = f"Task acceptance.hold[{c.id}] received"
    deadline = time.monotonic() + 30
    while received not in cluster.logs["w1"].read_text(errors="replace"):  # C waits in W1's memory (prefetched)
        assert time.monotonic() < deadline, cluster.logs["w1"].read_text()[-3000:]
        time.sleep(0.05)
    assert cluster.scalar("SELECT count(*) FROM keyed_claims") == 1  # only A's: C holds no claim while it waits
    assert producer.app.control.add_consumer(queue, destination=[w2], reply=True, timeout=10), "W2 did not answer"
    b = producer.hold.delay("acct:x", 0.1, note="B")
    cluster.wait_for("SELECT count(*) FROM keyed_waiting", 1)

    assert b.get(timeout=60) == "B"
    assert a.get(timeout=60) == "A"
    c_ended = cluster.scalar("SELECT count(*) FROM observed WHERE task_id = :id AND kind = 'end'", id=c.id)
    assert c_ended == 0, "B waited for W1's pool, busy with C"
    assert c.get(timeout=60) == "C"
    assert peak_overlap(cluster.intervals("acct:x")) == 1
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)


def test_a_promotion_fetched_by_a_busy_worker_is_given_back_once_then_kept(cluster: Cluster, producer) -> None:
    """The other side of the busy-pool rule: W1's releaser publishes B's promotion (its pool is taken by C), and W1
    itself fetches it with the prefetch slot A's ack freed (here W1 is the only worker left; in a cluster it races the
    idle ones for it). W1 gives it back to the broker once instead of holding its slot behind C, then keeps it when
    it comes back (no bouncing for ever when every pool is busy): B runs once, after C started, the mutex holds."""
    cluster.env.update(KEYED_LEASE=str(LEASE))
    cluster.start_worker("w2", concurrency=1)  # parks B (acct:x runs on W1), then leaves
    queue = producer.app.conf.task_default_queue
    w2 = f"w2@{socket.gethostname()}"
    assert producer.app.control.cancel_consumer(queue, destination=[w2], reply=True, timeout=10), "W2 did not answer"
    cluster.start_worker("w1", concurrency=1, extra=["--prefetch-multiplier", "2"])
    a = producer.hold.delay("acct:x", 4.0, note="A")  # long enough for B to be parked on a loaded machine
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start'", 1)
    c = producer.hold.delay("acct:y", 3.0, note="C")
    received = f"Task acceptance.hold[{c.id}] received"
    deadline = time.monotonic() + 30
    while received not in cluster.logs["w1"].read_text(errors="replace"):  # C waits in W1's memory
        assert time.monotonic() < deadline, cluster.logs["w1"].read_text()[-3000:]
        time.sleep(0.05)
    assert producer.app.control.add_consumer(queue, destination=[w2], reply=True, timeout=10), "W2 did not answer"
    b = producer.hold.delay("acct:x", 0.1, note="B")
    cluster.wait_for("SELECT count(*) FROM keyed_waiting WHERE task_id = :id", 1, id=b.id)
    cluster.kill_worker("w2", signal.SIGTERM)

    assert [r.get(timeout=60) for r in (a, c, b)] == ["A", "C", "B"]
    log = cluster.logs["w1"].read_text(errors="replace")
    assert log.count(f"promoted {b.id} given back to the broker") == 1, log[-3000:]
    assert log.count(f"Task acceptance.hold[{b.id}] received") == 2, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert _interval(cluster, b.id)[0] >= _interval(cluster, c.id)[0]
    assert peak_overlap(cluster.intervals("acct:x")) == 1
    assert _books(cluster, b.id) == "completed", log[-3000:]
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)


def test_a_task_of_several_keys_waiting_for_a_process_keeps_the_worker_alive(cluster: Cluster, producer) -> None:
    """A task of several keys (its key header is a list) waits in W1's memory for the one pool process while A holds
    the mutex acct:m there; then B of acct:m arrives, which is parked at receipt after a look at the requests
    waiting here. That look hashed the list and raised on the consumer loop, and the worker died ("Unrecoverable
    error"; the demo's partner-API calls, sixth session). The worker keeps serving, everything runs once, the mutex
    holds."""
    cluster.start_worker("w1", concurrency=1, extra=["--prefetch-multiplier", "4"])
    a = producer.hold.delay("acct:m", 2.0, note="A")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start'", 1)
    several = producer.hold.apply_async(("several", 0.2), {"note": "S"}, concurrency_key=["acct:n", "api:n"])
    received = f"Task acceptance.hold[{several.id}] received"
    deadline = time.monotonic() + 30
    while received not in cluster.logs["w1"].read_text(errors="replace"):
        assert time.monotonic() < deadline, cluster.logs["w1"].read_text()[-3000:]
        time.sleep(0.05)
    b = producer.hold.delay("acct:m", 0.1, note="B")
    assert [r.get(timeout=60) for r in (a, several, b)] == ["A", "S", "B"]
    assert producer.ping.delay("alive").get(timeout=30) == "alive"
    log = cluster.logs["w1"].read_text(errors="replace")
    assert "Unrecoverable error" not in log and "Traceback" not in log, log[-3000:]
    assert peak_overlap(cluster.intervals("acct:m")) == 1


def test_a_null_key_header_is_still_gated(cluster: Cluster, producer) -> None:
    """``headers={"keyed_key": None}`` from a foreign producer: the keys are computed from the arguments."""
    cluster.start_worker("w1", concurrency=4)
    results = [
        producer.app.send_task(
            "acceptance.hold", args=["acct:null", 0.4], headers={"keyed_key": None, "keyed_group": None}
        )
        for _ in range(3)
    ]
    assert [r.get(timeout=60) for r in results] == ["", "", ""]
    assert peak_overlap(cluster.intervals("acct:null")) == 1
    # the release that books a task runs just after its result is stored
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE key = 'acct:null' AND outcome = 'completed'", 3)


def test_poison_messages_are_recorded_rejections_and_the_worker_keeps_serving(cluster: Cluster, producer) -> None:
    """Keys that cannot be computed from a message's arguments, or headers out of the ledger's range, end as a
    recorded rejection with a ``KeyedRejected`` result; no worker dies (D16)."""
    cluster.start_worker("w1", concurrency=2)
    send = producer.app.send_task
    poison = {
        "missing argument": send("acceptance.charge", args=[]),
        "bad format": send("acceptance.fmt", args=["abc"]),
        "key raises": send("acceptance.divide", args=[0]),
        "retries out of range": send("acceptance.hold", args=["acct:p", 0.0], headers={"retries": 2**31}),
        "sequence out of range": send("acceptance.ordered", args=["order:p", 1], headers={"keyed_group_seq": 2**63}),
        "cost not a number": send("acceptance.hold", args=["acct:q", 0.0], headers={"keyed_cost": "x"}),
    }
    for what, result in poison.items():
        with pytest.raises(KeyedRejected):
            result.get(timeout=60, propagate=True)
        assert _books(cluster, result.id) == "rejected", what
    assert producer.ping.delay("alive").get(timeout=30) == "alive"
    assert producer.hold.delay("acct:p", 0.0, note="fine").get(timeout=30) == "fine"
    assert cluster.workers["w1"].poll() is None
    assert "Unrecoverable error" not in cluster.logs["w1"].read_text()


@pytest.fixture
def pg_outage_producer(pg_outage_cluster: Cluster) -> Iterator[Any]:
    yield from _producer_for(pg_outage_cluster)


def test_a_finished_task_whose_release_could_not_commit_is_not_lost_with_its_worker(
    pg_outage_cluster: Cluster, own_postgres: PostgresServer, pg_outage_producer: Any
) -> None:
    """An acks_late task ends while Postgres is down (its release waits in memory), then its worker is
    SIGKILLed. The ack waits for the release (D15), so the broker still holds the message: it is delivered
    again and the task ends in the books with one outcome — not acked, lost and open for ever."""
    cluster, producer = pg_outage_cluster, pg_outage_producer
    cluster.env.update(KEYED_LEASE=str(LEASE), VISIBILITY_TIMEOUT="4")
    cluster.start_worker("w1", concurrency=2)
    napping = producer.nap.delay("nap:1", 2.0)
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 1)
    cluster.engine.dispose()
    own_postgres.suspend()
    try:
        assert napping.get(timeout=30) == "napped"  # the body ended; its release cannot commit
        time.sleep(1.0)
        cluster.kill_worker("w1")
    finally:
        own_postgres.resume()
    cluster.start_worker("w2", concurrency=2)
    cluster.wait_for("SELECT outcome FROM keyed_tasks WHERE task_id = :id", "completed", timeout=90, id=napping.id)
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0, timeout=60)


def test_a_restarted_worker_gives_back_its_dead_predecessors_slots_at_once(cluster: Cluster, producer) -> None:
    """SIGKILL a worker (main and pool processes) holding a key, restart it on the same machine: the slot comes
    back as soon as the new start sees that none of the old processes exists, not after the lease (60 s here)."""
    cluster.env.update(KEYED_LEASE="60", VISIBILITY_TIMEOUT="5")
    cluster.start_worker("w1", concurrency=2)
    first = producer.hold.delay("acct:crash", 6.0, note="first")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start'", 1)
    second = producer.hold.delay("acct:crash", 0.1, note="second")
    cluster.wait_for("SELECT count(*) FROM keyed_waiting", 1)
    cluster.kill_worker("w1")  # the whole process group: no body of it runs any more
    killed_at = cluster.scalar("SELECT extract(epoch FROM clock_timestamp())")
    cluster.start_worker("w1", concurrency=2)
    assert second.get(timeout=30) == "second"  # well inside the 60 s lease
    detail = cluster.scalar("SELECT detail FROM keyed_events WHERE kind = 'reclaimed' AND task_id = :id", id=first.id)
    assert detail is not None and "processes are gone" in detail
    assert first.get(timeout=90) == "first"  # acks_late: redelivered, and run again once it holds the slot
    second_span = _interval(cluster, second.id)
    rerun_start = cluster.scalar(
        "SELECT extract(epoch FROM max(at)) FROM observed WHERE task_id = :id AND kind = 'start'", id=first.id
    )
    rerun_end = cluster.scalar(
        "SELECT extract(epoch FROM max(at)) FROM observed WHERE task_id = :id AND kind = 'end'", id=first.id
    )
    assert second_span[0] >= float(killed_at)
    assert float(rerun_start) >= second_span[1] or second_span[0] >= float(rerun_end)  # K = 1 after the crash
