"""The acceptance core on RabbitMQ: real prefork workers consuming from a throwaway RabbitMQ (``amqp://``, a
vhost per test), the ledger in Postgres, results in Redis, and the same independent observer (``observed``) as
tests/acceptance/test_gate.py, whose checks these keep.

What differs from Redis: RabbitMQ redelivers the unacknowledged messages of a worker the moment its connection
closes (no visibility timeout, no unacked-restore scan), and the broker's own firehose tracer (``Tap``) shows every
message published in the vhost with its headers, where the Redis tests count LPUSH calls.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
from kombu import Connection, Exchange, Queue

from celery_keyed.testing import RabbitServer, RabbitTarget
from tests.acceptance.conftest import Cluster, make_cluster, peak_overlap

SERVICE = 0.2  # seconds: one time unit of service
TAP = "keyed-test-tap"


@pytest.fixture
def cluster(
    database_url: str, amqp_url: str, redis_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    """Workers on RabbitMQ (``CELERY_BROKER_URL=amqp://…``); results in Redis (``CELERY_RESULT_BACKEND``)."""
    limits = getattr(request, "param", None) or {}
    for c in make_cluster(database_url, amqp_url, tmp_path, limits):
        c.env["CELERY_RESULT_BACKEND"] = redis_url
        yield c


@pytest.fixture
def producer(cluster: Cluster) -> Iterator[Any]:
    from celery_keyed.publisher import close_publisher
    from tests.acceptance.proj import make_app

    ns = make_app(cluster.env)
    assert ns.app.connection_for_write().transport.driver_type == "amqp"
    yield ns
    close_publisher(ns.app)
    ns.app.close()


class Tap:
    """RabbitMQ's firehose tracer on the test's vhost (``rabbitmqctl trace_on``): a copy of every message
    published in the vhost, by anyone (the producer, Celery's retries, the gate's republished promotions), with
    its headers and properties, for the test to read afterwards. (Celery publishes to the default exchange, to
    which no queue can be bound: the tracer sees those publishes too.)"""

    def __init__(self, server: RabbitServer, url: str) -> None:
        self.server = server
        self.vhost = unquote(urlsplit(url).path[1:])
        self.conn = Connection(url)
        self.queue = Queue(TAP, Exchange("amq.rabbitmq.trace", type="topic", passive=True), routing_key="publish.#")
        self.queue(self.conn.default_channel).declare()
        server.ctl("trace_on", "-p", self.vhost)

    def published(self, routing_key: str = "celery") -> list[tuple[dict[str, Any], bytes]]:
        """(properties with headers, body) of each message published with ``routing_key``, in order."""
        bound = self.queue(self.conn.default_channel)
        seen = []
        while (message := bound.get(no_ack=True)) is not None:
            if routing_key in message.headers.get("routing_keys", []):
                properties = dict(message.headers.get("properties") or {})
                properties["headers"] = dict(properties.get("headers") or {})
                seen.append((properties, message.body))
        return seen

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.server.ctl("trace_off", "-p", self.vhost)
        self.conn.release()


@pytest.fixture
def tap(cluster: Cluster, rabbitmq_server: RabbitTarget) -> Iterator[Tap]:
    if not isinstance(rabbitmq_server, RabbitServer):
        pytest.skip("the tracer is switched on with rabbitmqctl: needs a RabbitMQ the test bed started")
    t = Tap(rabbitmq_server, cluster.broker_url)
    yield t
    t.close()


def log_of(cluster: Cluster, name: str) -> str:
    return cluster.logs[name].read_text(errors="replace")


def wait_log(cluster: Cluster, name: str, text: str, timeout: float = 10.0) -> None:
    """Wait for ``text`` in a worker's log (a line may come just after the result is stored)."""
    deadline = time.monotonic() + timeout
    while text not in log_of(cluster, name):
        assert time.monotonic() < deadline, f"{text!r} not in {name}'s log:\n{log_of(cluster, name)[-3000:]}"
        time.sleep(0.05)


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_mutex_per_account_across_two_workers(cluster: Cluster, producer) -> None:
    """K = 1 under contention: the cap holds across two workers, accounts run in parallel."""
    cluster.start_worker("w1")
    cluster.start_worker("w2")
    t0 = time.time()
    for i in range(10):
        for account in ("account:1", "account:2", "account:3"):
            producer.hold.delay(account, SERVICE, note=str(i))
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", 30, timeout=60)
    makespan = time.time() - t0
    for account in ("account:1", "account:2", "account:3"):
        intervals = cluster.intervals(account)
        assert len(intervals) == 10
        assert peak_overlap(intervals) == 1, f"two tasks of {account} overlapped"
    assert peak_overlap(cluster.intervals()) >= 2  # accounts ran in parallel
    assert makespan < 10 * SERVICE * 2.5, f"makespan {makespan:.1f}s: accounts did not run in parallel"
    pids = {r.pid for r in cluster.rows("SELECT DISTINCT pid FROM observed")}
    assert len(pids) >= 2
    # every body has ended; each release runs just after its result is stored: wait for the last ones
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
    cluster.wait_for("SELECT coalesce(sum(used), 0) FROM keyed_slots", 0)


@pytest.mark.parametrize("cluster", [{"gate": 5}], indirect=True)
def test_gate_k5_across_two_workers(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=4)
    cluster.start_worker("w2", concurrency=4)
    for i in range(30):
        producer.hold.delay("gate:stripe", SERVICE, note=str(i))
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", 30, timeout=60)
    assert peak_overlap(cluster.intervals("gate:stripe")) == 5
    pids = {r.pid for r in cluster.rows("SELECT DISTINCT pid FROM observed")}
    assert len(pids) >= 5
    # every body has ended; each release runs just after its result is stored: wait for the last ones
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_parked_task_promoted_is_republished_to_rabbitmq_with_its_nonce(cluster: Cluster, producer, tap) -> None:
    """D5: the releasing worker does not consume the parked task's queue, so the promotion goes back through
    RabbitMQ with its admission nonce, and the worker that consumes the queue runs it at once."""
    cluster.start_worker("w1", concurrency=2, extra=["-Q", "only-w1"])
    cluster.start_worker("w2", concurrency=2)  # the default queue, celery
    first = producer.hold.apply_async(("acct:pro", 1.0), {"note": "first"}, queue="only-w1")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start'", 1)
    parked = producer.hold.apply_async(("acct:pro", 0.1), {"note": "parked"})
    cluster.wait_for("SELECT count(*) FROM keyed_waiting", 1)
    assert first.get(timeout=30) == "first"
    assert parked.get(timeout=30) == "parked"
    messages = [(props, body) for props, body in tap.published() if props["headers"].get("id") == parked.id]
    assert len(messages) == 2, messages  # the producer's, then the gate's republish
    (original, body), (republished, republished_body) = messages
    assert "keyed_nonce" not in original["headers"]
    assert republished["headers"].get("keyed_nonce"), republished
    assert republished.get("delivery_mode") == 2  # persistent, like Celery's own
    assert republished_body == body
    wait_log(cluster, "w2", f"acceptance.hold[{parked.id}] succeeded")
    assert parked.id not in log_of(cluster, "w1")
    starts = cluster.rows("SELECT note, extract(epoch FROM at) AS ts FROM observed WHERE kind = 'start' ORDER BY at")
    ends = cluster.rows("SELECT note, extract(epoch FROM at) AS ts FROM observed WHERE kind = 'end' ORDER BY at")
    assert [r.note for r in starts] == ["first", "parked"]
    assert float(starts[1].ts) - float(ends[0].ts) < 2.0  # promoted at the release, not after a sweep
    assert peak_overlap(cluster.intervals("acct:pro")) == 1
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome = 'completed'", 2)
    assert cluster.scalar("SELECT count(*) FROM keyed_claims") == 0


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_local_handoff_needs_no_broker_round_trip(cluster: Cluster, producer, tap) -> None:
    """D4: a worker that releases a slot runs the next parked attempt of the key from the stored message —
    RabbitMQ sees exactly the producer's messages, no republish."""
    cluster.start_worker("w1", concurrency=2)
    results = [producer.hold.delay("acct:local", 0.1, note=str(i)) for i in range(6)]
    assert [r.get(timeout=60) for r in results] == [str(i) for i in range(6)]
    headers = [props["headers"] for props, _ in tap.published()]
    assert sorted(h["id"] for h in headers) == sorted(r.id for r in results)  # six, none by the gate
    assert not [h for h in headers if "keyed_nonce" in h]
    assert cluster.scalar("SELECT count(*) FROM keyed_tasks WHERE outcome = 'completed'") >= 5
    assert peak_overlap(cluster.intervals("acct:local")) == 1


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_group_head_retries_block_the_group_then_it_continues(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1")
    cluster.start_worker("w2")
    producer.ordered.delay("order:7", 0, fail_times=2)
    for seq in (1, 2):
        producer.ordered.delay("order:7", seq)
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", 3, timeout=60)
    rows = cluster.rows("SELECT kind, note FROM observed ORDER BY at")
    assert [(r.kind, r.note) for r in rows] == [
        ("start", "0"), ("fail", "0"), ("start", "0"), ("fail", "0"), ("start", "0"), ("end", "0"),
        ("start", "1"), ("end", "1"), ("start", "2"), ("end", "2"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "cluster", [{"research": {"limit": 2, "max_waiting": 3, "max_wait": 6 * SERVICE * 2}}], indirect=True
)
def test_eight_arrivals_counts_timing_and_books(cluster: Cluster, producer) -> None:
    """A bounded waiting room: two run, three wait, three are rejected (KeyedRejected), one waits too long."""
    unit = SERVICE * 2
    cluster.start_worker("w1")
    cluster.start_worker("w2")
    results = [producer.hold.delay("research:x", 4 * unit, note=c) for c in "ABCDEFGH"]
    outcomes: dict[str, int] = defaultdict(int)
    for r in results:
        try:
            r.get(timeout=60)
            outcomes["completed"] += 1
        except Exception as exc:
            outcomes[type(exc).__name__] += 1
    assert outcomes == {"completed": 4, "KeyedRejected": 3, "KeyedExpired": 1}
    starts = sorted(
        float(r.ts) for r in cluster.rows("SELECT extract(epoch FROM at) AS ts FROM observed WHERE kind = 'start'")
    )
    assert len(starts) == 4
    assert starts[1] - starts[0] < unit  # two start at once
    assert 3.5 * unit < starts[2] - starts[0] < 5.5 * unit  # the next two start at 4
    assert abs(starts[3] - starts[2]) < unit
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome IS NOT NULL", 8)
    books = {r.outcome: r.n for r in cluster.rows("SELECT outcome, count(*) AS n FROM keyed_tasks GROUP BY outcome")}
    assert books == {"completed": 4, "expired": 1, "rejected": 3}


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_revoking_parked_tasks_records_them_and_completes_their_results(cluster: Cluster, producer) -> None:
    """``celery_keyed.revoke`` and Celery's own ``app.control.revoke`` (a broadcast through RabbitMQ's pidbox
    fanout exchange, to both workers) of parked tasks: recorded in the ledger, results fail with KeyedRevoked,
    they never run, and the key moves on."""
    from celery.exceptions import TaskRevokedError

    import celery_keyed
    from celery_keyed import KeyedRevoked

    cluster.start_worker("w1", concurrency=2)
    cluster.start_worker("w2", concurrency=2)
    first = producer.hold.delay("acct:rv", 2.0, note="first")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start'", 1)
    parked = producer.hold.delay("acct:rv", 0.1, note="parked")
    broadcast = producer.hold.delay("acct:rv", 0.1, note="broadcast")
    cluster.wait_for("SELECT count(*) FROM keyed_waiting", 2)
    celery_keyed.revoke(producer.app, parked.id)
    producer.app.control.revoke(broadcast.id)
    with pytest.raises((KeyedRevoked, TaskRevokedError)):  # Celery's revoke may store REVOKED first
        parked.get(timeout=30)
    with pytest.raises(KeyedRevoked):
        broadcast.get(timeout=30)
    for result in (parked, broadcast):
        assert cluster.scalar("SELECT outcome FROM keyed_tasks WHERE task_id = :id", id=result.id) == "revoked"
    assert cluster.scalar("SELECT count(*) FROM keyed_waiting") == 0
    assert first.get(timeout=30) == "first"
    assert producer.hold.delay("acct:rv", 0.1, note="then").get(timeout=30) == "then"  # no slot leaked
    assert cluster.scalar("SELECT count(*) FROM observed WHERE note IN ('parked', 'broadcast')") == 0
    assert peak_overlap(cluster.intervals("acct:rv")) == 1


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_sigkill_worker_mid_task_redelivered_on_connection_close(cluster: Cluster, producer) -> None:
    """acks_late + SIGKILL: RabbitMQ requeues the victim's unacknowledged message as soon as the dead worker's
    connection closes; the survivor keeps the redelivered copy as a shadow of the live claim (D8) until the claim is
    reclaimed (the lease lapses, D7, or sooner: the holder's processes are gone from this host); the copy runs;
    never two at once."""
    cluster.env.update(KEYED_LEASE="3")
    cluster.start_worker("w1", concurrency=1)
    victim = producer.hold.delay("acct:kill", 8.0, note="victim")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start'", 1)
    cluster.start_worker("w2", concurrency=2)
    producer.hold.delay("acct:kill", 0.2, note="next")
    time.sleep(0.3)
    # the victim must still run when it is killed (a loaded machine may take seconds to start w2)
    assert cluster.scalar("SELECT count(*) FROM observed WHERE kind = 'end'") == 0
    killed_at = time.time()  # the victim runs until the SIGKILL; nothing else of the key may start before it
    cluster.kill_worker("w1")
    # redelivered at once (no visibility timeout on RabbitMQ): w2 receives the copy well before the lease lapses
    wait_log(cluster, "w2", f"Task acceptance.hold[{victim.id}] received")
    redelivered_after = time.time() - killed_at
    assert redelivered_after < 5.0, f"redelivered {redelivered_after:.1f}s after the kill"
    assert victim.get(timeout=60) == "victim"
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", 2, timeout=60)
    starts = cluster.rows("SELECT note, extract(epoch FROM at) AS ts FROM observed WHERE kind = 'start' ORDER BY at")
    assert starts[0].note == "victim"
    assert all(float(r.ts) > killed_at for r in starts[1:]), "a task of the key started before the kill"
    rows = cluster.rows("SELECT kind, task_id, extract(epoch FROM at) AS ts FROM observed ORDER BY at")
    intervals, open_ = [(victim.id, float(rows[0].ts), killed_at)], {}
    for r in rows[1:]:
        if r.kind == "start":
            open_[r.task_id] = float(r.ts)
        else:
            intervals.append((r.task_id, open_.pop(r.task_id), float(r.ts)))
    assert peak_overlap(intervals) == 1
    assert cluster.scalar("SELECT count(*) FROM keyed_events WHERE kind = 'reclaimed'") == 1
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome = 'completed'", 2)
    assert cluster.scalar("SELECT count(*) FROM keyed_claims") == 0
