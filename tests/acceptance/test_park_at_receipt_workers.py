"""Park at receipt with a real prefork worker (issue 13, ``keyed_park_at_receipt``): an arrival of a key with a
line is parked as soon as the worker receives it, while every pool process is busy; it does not wait for a pool
process to park. Ordering-based: the parks are seen in the ledger while the tasks holding both pool processes
still run (their end is observed later)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.acceptance.conftest import Cluster


@pytest.fixture
def prefetching_cluster(cluster: Cluster) -> Cluster:
    cluster.env["KEYED_PREFETCH"] = "4"  # c=2: up to 8 messages reserved by the worker
    return cluster


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_arrivals_of_a_key_with_a_line_park_while_every_pool_process_is_busy(
    prefetching_cluster: Cluster, producer: Any
) -> None:
    cluster = prefetching_cluster
    cluster.start_worker("w1", concurrency=2)
    first = producer.hold.delay("acct:line", 12.0, note="A")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start' AND note = 'A'", 1)
    second = producer.hold.delay("acct:line", 0.05, note="B")  # the other process parks it: the key has a line
    cluster.wait_for("SELECT count(*) FROM keyed_waiting", 1)
    long = producer.sleepy.delay(12.0, note="L")  # now both pool processes are busy until A and L end
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start' AND note = 'L'", 1)
    later = [producer.hold.delay("acct:line", 0.05, note=f"C{i}") for i in range(3)]
    # Parked while A and L still hold both pool processes: without park at receipt they would wait for one.
    cluster.wait_for("SELECT count(*) FROM keyed_waiting", 4, timeout=10.0)
    assert cluster.scalar("SELECT count(*) FROM observed WHERE kind = 'end' AND note IN ('A', 'L')") == 0
    assert cluster.scalar("SELECT count(*) FROM keyed_claims") == 1  # A's: nothing claimed at receipt (D3)
    assert first.get(timeout=60) == "A"
    assert second.get(timeout=60) == "B"
    assert [r.get(timeout=60) for r in later] == ["C0", "C1", "C2"]
    assert long.get(timeout=60) == "L"
    order = [
        r.note for r in cluster.rows("SELECT note FROM observed WHERE kind = 'start' AND key = 'acct:line' ORDER BY at")
    ]
    assert order == ["A", "B", "C0", "C1", "C2"]
    overlapping = cluster.scalar(
        "SELECT count(*) FROM observed s1 JOIN observed e1 ON e1.task_id = s1.task_id AND e1.kind = 'end'"
        " JOIN observed s2 ON s2.key = s1.key AND s2.kind = 'start' AND s2.task_id <> s1.task_id"
        " WHERE s1.kind = 'start' AND s1.key = 'acct:line' AND s2.at > s1.at AND s2.at < e1.at"
    )
    assert overlapping == 0


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_arrivals_of_a_mutex_key_running_here_park_at_receipt_before_any_line(
    prefetching_cluster: Cluster, producer: Any
) -> None:
    """The key has never parked anything here (no line yet): its attempt runs in this worker and its name is a
    mutex, so the arrivals behind it have no room and are parked the moment they are received — not one by one as
    pool processes free up (a burst would otherwise hold every prefetched message until a process parks it)."""
    cluster = prefetching_cluster
    cluster.start_worker("w1", concurrency=2)
    first = producer.hold.delay("acct:fresh", 12.0, note="A")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start' AND note = 'A'", 1)
    long = producer.sleepy.delay(12.0, note="L")  # both pool processes busy until A and L end
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start' AND note = 'L'", 1)
    later = [producer.hold.delay("acct:fresh", 0.05, note=f"C{i}") for i in range(3)]
    cluster.wait_for("SELECT count(*) FROM keyed_waiting", 3, timeout=10.0)
    assert cluster.scalar("SELECT count(*) FROM observed WHERE kind = 'end' AND note IN ('A', 'L')") == 0
    assert cluster.scalar("SELECT count(*) FROM keyed_claims") == 1  # A's: nothing claimed at receipt (D3)
    assert first.get(timeout=60) == "A"
    assert [r.get(timeout=60) for r in later] == ["C0", "C1", "C2"]
    assert long.get(timeout=60) == "L"
    starts = "SELECT note FROM observed WHERE kind = 'start' AND key = 'acct:fresh' ORDER BY at"
    assert [r.note for r in cluster.rows(starts)] == ["A", "C0", "C1", "C2"]


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_without_park_at_receipt_the_arrivals_wait_for_a_pool_process(
    prefetching_cluster: Cluster, producer: Any
) -> None:
    """The control: the same sequence with ``keyed_park_at_receipt = False`` parks nothing more while both pool
    processes are busy (what the test above would see without the feature)."""
    cluster = prefetching_cluster
    cluster.env["KEYED_PARK_AT_RECEIPT"] = "0"
    cluster.start_worker("w1", concurrency=2)
    first = producer.hold.delay("acct:line", 4.0, note="A")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start' AND note = 'A'", 1)
    producer.hold.delay("acct:line", 0.05, note="B")
    cluster.wait_for("SELECT count(*) FROM keyed_waiting", 1)
    long = producer.sleepy.delay(4.0, note="L")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start' AND note = 'L'", 1)
    later = [producer.hold.delay("acct:line", 0.05, note=f"C{i}") for i in range(3)]
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end' AND note = 'A'", 1, timeout=30)
    # Until A ended, no pool process was free: the three arrivals stayed out of the ledger.
    a_end = cluster.scalar("SELECT at FROM observed WHERE kind = 'end' AND note = 'A'")
    recorded = cluster.scalar(
        "SELECT count(*) FROM keyed_tasks WHERE task_id = ANY(CAST(:ids AS text[])) AND arrived_at < :a",
        ids=[r.id for r in later],
        a=a_end,
    )
    assert recorded == 0
    assert first.get(timeout=60) == "A"
    assert [r.get(timeout=60) for r in later] == ["C0", "C1", "C2"]
    assert long.get(timeout=60) == "L"


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_requests_waiting_for_a_pool_process_park_once_their_key_runs_here(
    prefetching_cluster: Cluster, producer: Any
) -> None:
    """Arrivals received while their key was idle here wait in Celery's pool semaphore for a process. When the first
    of them starts (its mutex now runs here), the others are taken out of that line and parked without a process
    (``GateService.park_waiting``) — not one by one as processes free up, each holding one for a round trip while a
    promotion bound here waits for it. Their order is kept."""
    cluster = prefetching_cluster
    cluster.start_worker("w1", concurrency=2)
    short = producer.sleepy.delay(2.0, note="L1")
    long = producer.sleepy.delay(14.0, note="L2")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start' AND note IN ('L1', 'L2')", 2)
    calls = [producer.hold.delay("acct:pull", 6.0 if i == 0 else 0.05, note=f"C{i}") for i in range(3)]
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start' AND note = 'C0'", 1, timeout=30.0)
    # C0 runs (6 s) and L2 holds the other process: C1 and C2 park while no process is free.
    cluster.wait_for("SELECT count(*) FROM keyed_waiting", 2, timeout=4.0)
    assert cluster.scalar("SELECT count(*) FROM observed WHERE kind = 'end' AND note IN ('C0', 'L2')") == 0
    assert [r.get(timeout=60) for r in calls] == ["C0", "C1", "C2"]
    assert short.get(timeout=60) == "L1"
    assert long.get(timeout=60) == "L2"
    starts = "SELECT note FROM observed WHERE kind = 'start' AND key = 'acct:pull' ORDER BY at"
    assert [r.note for r in cluster.rows(starts)] == ["C0", "C1", "C2"]
