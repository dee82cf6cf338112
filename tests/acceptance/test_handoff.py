"""Local handoff during a burst of arrivals (issue 13): a worker whose pool processes are only reserved by
prefetched arrivals of contended keys (they will park) still starts its promotions itself, and a promotion
started here takes the first pool process that frees, ahead of the requests prefetched before it. Published
instead, the promotion would wait behind the broker's whole queue. Ordering-based (what the ledger recorded
before the promotion started), not timing-based."""

from __future__ import annotations

from typing import Any

import pytest

from tests.acceptance.conftest import Cluster


@pytest.fixture
def prefetching_cluster(cluster: Cluster) -> Cluster:
    cluster.env["KEYED_PREFETCH"] = "4"  # c=2: up to 8 messages reserved by the worker
    return cluster


@pytest.mark.parametrize("cluster", [{}], indirect=True)
@pytest.mark.parametrize("park_at_receipt", ["0", "1"])
def test_a_local_promotion_goes_ahead_of_a_burst_of_arrivals(
    prefetching_cluster: Cluster, producer: Any, park_at_receipt: str
) -> None:
    """With ``keyed_park_at_receipt`` off, the arrivals of the burst wait for a pool process to park, and B takes
    the first one that frees, ahead of them. On (the default), they park as soon as they are received, without a
    pool process: all of them are in the ledger, behind B, before B starts, and B still starts first."""
    cluster = prefetching_cluster
    cluster.env["KEYED_PARK_AT_RECEIPT"] = park_at_receipt
    cluster.start_worker("w1", concurrency=2)
    first = producer.hold.delay("acct:jump", 2.5, note="A")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start' AND note = 'A'", 1)
    promoted = producer.hold.delay("acct:jump", 0.05, note="B")  # parks behind A (the other process admits it)
    cluster.wait_for("SELECT count(*) FROM keyed_waiting", 1)
    long = producer.sleepy.delay(5.0, note="L")  # the other process runs it until after A has ended
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start' AND note = 'L'", 1)
    # A burst of arrivals of the key, behind B: each needs a pool process for a moment to park; the worker
    # prefetches some, the rest wait in the broker. Sent before A ends, so B's promotion comes after them.
    burst = [producer.hold.delay("acct:jump", 0.01, note=f"burst{i}") for i in range(12)]
    assert first.get(timeout=60) == "A"
    assert promoted.get(timeout=60) == "B"
    assert [r.get(timeout=90) for r in burst] == [f"burst{i}" for i in range(12)]
    assert long.get(timeout=60) == "L"
    b_started = cluster.scalar("SELECT min(at) FROM observed WHERE kind = 'start' AND note = 'B'")
    recorded_before = cluster.scalar(
        "SELECT count(*) FROM keyed_tasks WHERE task_id = ANY(CAST(:ids AS text[])) AND arrived_at < :b",
        ids=[r.id for r in burst],
        b=b_started,
    )
    if park_at_receipt == "0":
        # B went ahead of the prefetched arrivals waiting for a process: most of the burst reached the ledger after
        # B had started. Published, B would have come after every one of them (the broker's queue is FIFO).
        assert recorded_before < len(burst) - 3, f"{recorded_before} of the burst were recorded before B started"
    else:
        # Parked at receipt while A and L held both pool processes: none of them waited for a process.
        assert recorded_before == len(burst), f"{recorded_before} of the burst were recorded before B started"
    order = [
        r.note for r in cluster.rows("SELECT note FROM observed WHERE kind = 'start' AND key = 'acct:jump' ORDER BY at")
    ]
    assert order[:2] == ["A", "B"], order
    assert cluster.scalar("SELECT count(*) FROM keyed_claims") == 0
