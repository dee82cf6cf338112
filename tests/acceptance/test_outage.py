"""Postgres unreachable for longer than a lease while keyed tasks run (§3.9, D7, D9), with real workers."""

from __future__ import annotations

import time

from celery_keyed.testing import PostgresServer
from tests.acceptance.conftest import Cluster, peak_overlap

LEASE = 3.0


def test_postgres_down_longer_than_a_lease(pg_outage_cluster: Cluster, own_postgres: PostgresServer, producer) -> None:
    cluster = pg_outage_cluster
    cluster.env.update(KEYED_LEASE=str(LEASE), KEYED_SELF_FENCE="0")
    cluster.start_worker("w1", concurrency=3)
    running = producer.hold.delay("acct:1", 8.0, note="long")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start'", 1)
    waiting = producer.hold.delay("acct:1", 0.1, note="behind")  # parked behind the long one
    cluster.wait_for("SELECT count(*) FROM keyed_waiting", 1)
    cluster.engine.dispose()

    own_postgres.suspend()
    down_at = time.time()
    # unkeyed tasks keep flowing while the ledger is down
    assert [producer.ping.delay(str(i)).get(timeout=30) for i in range(3)] == ["0", "1", "2"]
    during = producer.hold.delay("acct:2", 0.1, note="during")  # keyed: held, not lost
    time.sleep(LEASE * 1.7)
    own_postgres.resume()
    up_at = time.time()
    assert up_at - down_at > LEASE

    assert during.get(timeout=60) == "during"  # intake resumed by itself
    assert running.get(timeout=60) == "long"
    assert waiting.get(timeout=60) == "behind"
    intervals = cluster.intervals("acct:1")
    assert peak_overlap(intervals) == 1, "the running task's slot was handed to another (D7)"
    starts = {
        r.note: float(r.ts)
        for r in cluster.rows("SELECT note, extract(epoch FROM at) AS ts FROM observed WHERE kind = 'start'")
    }
    assert starts["during"] > up_at - 0.5  # the keyed task started only once the ledger was back
    assert starts["behind"] > starts["long"] + 7.5  # it waited for the long task, not for the lease
    assert cluster.scalar("SELECT count(*) FROM keyed_events WHERE kind = 'reclaimed'") == 0
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome = 'completed'", 3)
    assert "the ledger is unreachable" in cluster.logs["w1"].read_text()


def test_self_fencing_terminates_keyed_tasks_it_can_no_longer_cover(
    pg_outage_cluster: Cluster, own_postgres: PostgresServer, producer
) -> None:
    """D7 on prefork (the default): a worker that cannot renew its leases terminates its keyed tasks before
    they expire; they are redelivered (acks_late) and run again once the ledger is back; never two at once."""
    cluster = pg_outage_cluster
    cluster.env.update(KEYED_LEASE=str(LEASE))
    cluster.start_worker("w1", concurrency=3)
    running = producer.hold.delay("acct:1", 6.0, note="long")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start'", 1)
    cluster.engine.dispose()
    own_postgres.suspend()
    time.sleep(LEASE * 1.5)
    own_postgres.resume()
    resumed_at = time.time()
    assert running.get(timeout=60) == "long"
    log = cluster.logs["w1"].read_text()
    assert "terminating acceptance.hold" in log
    starts = [
        float(r.ts)
        for r in cluster.rows("SELECT extract(epoch FROM at) AS ts FROM observed WHERE kind = 'start' ORDER BY at")
    ]
    assert len(starts) == 2 and starts[1] > resumed_at - 0.5  # ran again, only after the ledger came back
    assert cluster.scalar("SELECT count(*) FROM observed WHERE kind = 'end'") == 1


def _wait_for_log(cluster: Cluster, name: str, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in cluster.logs[name].read_text(errors="replace"):
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in the log of {name}:\n{cluster.logs[name].read_text()[-4000:]}")


def test_keyed_only_queues_are_not_consumed_while_postgres_is_down(
    pg_outage_cluster: Cluster, own_postgres: PostgresServer, producer
) -> None:
    """D9 with ``keyed_queues``: while the breaker is open the worker does not consume its keyed-only queue, so
    keyed messages published during the outage stay in the broker (not unacked in the worker's memory, where
    they would use up its prefetch); unkeyed tasks on the other queue flow; all complete once Postgres is back."""
    import redis as redis_client

    cluster = pg_outage_cluster
    cluster.env.update(KEYED_LEASE=str(LEASE), KEYED_QUEUES='["keyed_only"]')
    cluster.start_worker("w1", concurrency=2, extra=["-Q", "celery,keyed_only"])
    assert producer.hold.apply_async(("acct:q", 0.05), {"note": "warm"}, queue="keyed_only").get(timeout=30) == "warm"
    cluster.engine.dispose()

    own_postgres.suspend()
    _wait_for_log(cluster, "w1", "stopped consuming keyed-only queue 'keyed_only'")
    keyed = [
        producer.hold.apply_async((f"acct:q{i}", 0.05), {"note": f"k{i}"}, queue="keyed_only") for i in range(5)
    ]
    # The worker keeps consuming its other queue: these complete after the keyed messages were published.
    assert [producer.ping.delay(str(i)).get(timeout=30) for i in range(4)] == ["0", "1", "2", "3"]
    broker = redis_client.Redis.from_url(cluster.broker_url)
    try:
        assert broker.llen("keyed_only") == 5, "keyed messages left the broker while the ledger was down"
        own_postgres.resume()
        up_at = time.time()
        assert [r.get(timeout=60) for r in keyed] == [f"k{i}" for i in range(5)]
        assert broker.llen("keyed_only") == 0
    finally:
        broker.close()
    _wait_for_log(cluster, "w1", "consuming keyed-only queue 'keyed_only' again")
    starts = cluster.rows("SELECT extract(epoch FROM at) AS ts FROM observed WHERE kind = 'start' AND note LIKE 'k%'")
    assert len(starts) == 5 and min(float(r.ts) for r in starts) > up_at - 0.5
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome = 'completed'", 6)
