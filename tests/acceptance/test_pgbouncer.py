"""The acceptance core through PgBouncer: real prefork workers (and the producer) reach the ledger through a
throwaway PgBouncer (Debian's 1.18, its settings left at their defaults) in session and in transaction pooling mode;
the independent observer reads the same database directly. Nothing is configured for the pooler: the ledger finds it
(it refuses the startup options) and keeps no session state it would lose.

(Found on a release without this: nothing ran through PgBouncer in either mode — every ledger connection failed with
``unsupported startup parameter: options``; told to ignore them, transaction mode booked valid tasks as rejected
when a prepared statement was on another server connection.)"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_keyed.testing import POOL_MODES, PgBouncerServer
from tests.acceptance.conftest import Cluster, make_cluster, peak_overlap

SERVICE = 0.2  # seconds: one time unit of service


@pytest.fixture(params=POOL_MODES)
def pool_mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest,
    pool_mode: str,
    database_url: str,
    redis_url: str,
    tmp_path: Path,
    pgbouncers: Callable[..., PgBouncerServer],
) -> Iterator[Cluster]:
    """Workers and producer on ``KEYED_DATABASE_URL`` through PgBouncer in ``pool_mode``; limits as
    tests/acceptance/conftest.py's ``cluster`` takes them."""
    limits = getattr(request, "param", None) or {}
    through = pgbouncers(pool_mode).through(database_url)
    for c in make_cluster(database_url, redis_url, tmp_path, limits):  # the observer connects directly
        c.env["KEYED_DATABASE_URL"] = through
        yield c


def books(cluster: Cluster) -> dict[str, int]:
    return {r.outcome: r.n for r in cluster.rows("SELECT outcome, count(*) AS n FROM keyed_tasks GROUP BY outcome")}


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_mutex_per_account_across_two_workers(cluster: Cluster, producer: Any) -> None:
    """K = 1 under contention, through the pooler: the cap holds across two workers, accounts run in parallel, the
    books balance and every slot comes back."""
    cluster.start_worker("w1")
    cluster.start_worker("w2")
    for i in range(10):
        for account in ("account:1", "account:2", "account:3"):
            producer.hold.delay(account, SERVICE, note=str(i))
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", 30, timeout=120)
    for account in ("account:1", "account:2", "account:3"):
        intervals = cluster.intervals(account)
        assert len(intervals) == 10
        assert peak_overlap(intervals) == 1, f"two tasks of {account} overlapped"
    assert peak_overlap(cluster.intervals()) >= 2  # accounts ran in parallel
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
    cluster.wait_for("SELECT coalesce(sum(used), 0) FROM keyed_slots", 0)
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome = 'completed'", 30)
    assert books(cluster) == {"completed": 30}


@pytest.mark.parametrize("cluster", [{"gate": 5}], indirect=True)
def test_gate_k5_across_two_workers(cluster: Cluster, producer: Any) -> None:
    cluster.start_worker("w1", concurrency=4)
    cluster.start_worker("w2", concurrency=4)
    for i in range(30):
        producer.hold.delay("gate:stripe", SERVICE, note=str(i))
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", 30, timeout=120)
    assert peak_overlap(cluster.intervals("gate:stripe")) == 5
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome = 'completed'", 30)
    assert books(cluster) == {"completed": 30}


@pytest.mark.parametrize(
    "cluster", [{"research": {"limit": 2, "max_waiting": 3, "max_wait": 6 * SERVICE * 2}}], indirect=True
)
def test_eight_arrivals_only_the_waiting_room_rejects(cluster: Cluster, producer: Any) -> None:
    """A bounded waiting room through the pooler: two run, three wait, three are rejected because the room is full,
    one waits too long — and no task is rejected for anything else."""
    unit = SERVICE * 2
    cluster.start_worker("w1")
    cluster.start_worker("w2")
    results = [producer.hold.delay("research:x", 4 * unit, note=c) for c in "ABCDEFGH"]
    outcomes: dict[str, int] = defaultdict(int)
    for r in results:
        try:
            r.get(timeout=120)
            outcomes["completed"] += 1
        except Exception as exc:
            outcomes[type(exc).__name__] += 1
    assert outcomes == {"completed": 4, "KeyedRejected": 3, "KeyedExpired": 1}
    assert peak_overlap(cluster.intervals("research:x")) == 2
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome IS NOT NULL", 8)
    assert books(cluster) == {"completed": 4, "expired": 1, "rejected": 3}
    details = [r.detail for r in cluster.rows("SELECT detail FROM keyed_tasks WHERE outcome = 'rejected'")]
    assert all("waiting room" in (d or "") for d in details), details
