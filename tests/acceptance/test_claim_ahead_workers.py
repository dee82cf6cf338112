"""Claims taken ahead (``keyed_claim_ahead``, issue 13) with real prefork workers: a received request that will
wait for a busy pool process, not long, has its slot claimed while it waits, with the arrivals received meanwhile
in one round trip. Evidence from the ledger's own clock: a claim taken while both pool processes were running
bodies (``observed.claimed_at``, read by each body from its claim) — under D3 a claim waits for a free process.
The bound, the order of a key's arrivals and the slots of a worker that stops with claims taken ahead hold."""

from __future__ import annotations

from typing import Any

import pytest

from tests.acceptance.conftest import Cluster, peak_overlap

# A claim taken while two other bodies were running (each between its start and its end at that instant).
CLAIMED_WHILE_BOTH_BUSY = """
SELECT count(*) FROM observed x
 WHERE x.kind = 'start' AND x.claimed_at IS NOT NULL AND x.note = ANY(CAST(:notes AS text[]))
   AND (SELECT count(DISTINCT s.task_id) FROM observed s
         JOIN observed e ON e.task_id = s.task_id AND e.kind = 'end'
        WHERE s.kind = 'start' AND s.task_id <> x.task_id AND s.at <= x.claimed_at AND e.at >= x.claimed_at) >= 2
"""


@pytest.fixture
def prefetching_cluster(cluster: Cluster) -> Cluster:
    cluster.env["KEYED_PREFETCH"] = "4"  # c=2: up to 8 messages reserved by the worker
    return cluster


def _warm(producer: Any) -> None:
    """Short runs, so that the worker knows its typical run (a request's expected wait is counted in it): a few ms
    each, well under the 100 ms above which a request behind both busy processes would not be claimed ahead."""
    for result in [producer.hold.delay(f"warm:{i}", 0.005, note=f"warm{i}") for i in range(8)]:
        assert result.get(timeout=60) is not None


def _behind_both_busy(cluster: Cluster, producer: Any) -> list[Any]:
    """Both pool processes run a long body (A, B); then two more arrivals on keys of their own (C, D) wait for a
    process. Returns their results, once all four ended. (A claim taken ahead that no process took within the
    heartbeat interval, 1.7 s here, would go back: A and B are well under it.)"""
    long = [producer.hold.delay(f"long:{n}", 0.6, note=n) for n in ("A", "B")]
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start' AND note IN ('A', 'B')", 2)
    waiting = [producer.hold.delay(f"solo:{n}", 0.01, note=n) for n in ("C", "D")]
    return [r.get(timeout=60) for r in long + waiting]


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_requests_waiting_for_a_busy_pool_have_their_slots_claimed_ahead_and_the_bound_and_order_hold(
    prefetching_cluster: Cluster, producer: Any
) -> None:
    cluster = prefetching_cluster
    # Up to 0.5 s of expected wait: C and D qualify on a loaded machine too (the typical run of the short warm-up
    # tasks, over two processes, is what they are expected to wait).
    cluster.env["KEYED_CLAIM_AHEAD"] = "0.5"
    cluster.start_worker("w1", concurrency=2)
    _warm(producer)
    assert _behind_both_busy(cluster, producer) == ["A", "B", "C", "D"]
    # C or D had its slot while A and B still ran (the wait expected from the short typical run is short).
    assert cluster.scalar(CLAIMED_WHILE_BOTH_BUSY, notes=["C", "D"]) >= 1, cluster.rows("SELECT * FROM observed")

    # Mutex keys, their arrivals interleaved: one at a time per key, in the order published (D10).
    mutex = [producer.hold.delay(f"acct:{k}", 0.01, note=f"acct{k}-{r}") for r in range(5) for k in range(4)]
    assert [r.get(timeout=120) for r in mutex] == [f"acct{k}-{r}" for r in range(5) for k in range(4)]
    for k in range(4):
        assert peak_overlap(cluster.intervals(f"acct:{k}")) == 1
        starts = cluster.rows(
            "SELECT note FROM observed WHERE kind = 'start' AND key = :key ORDER BY at", key=f"acct:{k}"
        )
        assert [r.note for r in starts] == [f"acct{k}-{r}" for r in range(5)]
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0, timeout=30)
    assert cluster.scalar("SELECT coalesce(sum(used), 0) FROM keyed_slots") == 0


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_with_a_prefetch_of_one_the_window_widens_so_that_slots_are_claimed_ahead(
    cluster: Cluster, producer: Any
) -> None:
    """``worker_prefetch_multiplier = 1`` (the README's advice) with late acks: the two running bodies fill Celery's
    window, so C and D would stay in the broker until a process frees and could not be claimed ahead. The gate widens
    the window by what the pool is expected to start within ``keyed_claim_ahead`` (``GateService.fit_prefetch``):
    C or D is received and has its slot while A and B still run. Fails without the widening."""
    cluster.env["KEYED_CLAIM_AHEAD"] = "0.5"
    cluster.start_worker("w1", concurrency=2)
    _warm(producer)
    assert _behind_both_busy(cluster, producer) == ["A", "B", "C", "D"]
    assert cluster.scalar(CLAIMED_WHILE_BOTH_BUSY, notes=["C", "D"]) >= 1, cluster.rows("SELECT * FROM observed")
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0, timeout=30)


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_without_claim_ahead_no_slot_is_claimed_before_a_pool_process_is_free(
    prefetching_cluster: Cluster, producer: Any
) -> None:
    """The control (``keyed_claim_ahead = False``, D3 as written): the same evidence query finds nothing."""
    cluster = prefetching_cluster
    cluster.env["KEYED_CLAIM_AHEAD"] = "0"
    cluster.start_worker("w1", concurrency=2)
    _warm(producer)
    assert _behind_both_busy(cluster, producer) == ["A", "B", "C", "D"]
    assert cluster.scalar(CLAIMED_WHILE_BOTH_BUSY, notes=["C", "D"]) == 0


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_a_worker_stopped_with_claims_taken_ahead_strands_no_slot_and_every_task_runs_once(
    prefetching_cluster: Cluster, producer: Any
) -> None:
    """Warm shutdown while requests with claims taken ahead wait for a pool process: Celery does not start them and
    their messages go back to the broker (acks late); their claims go back with the worker (nothing is held by a
    worker that is gone). A second worker runs them: every task once (but for Celery's own at-least-once, below),
    never two runs of a key at once, each key's slot free at the end."""
    import os
    import signal

    cluster = prefetching_cluster
    cluster.start_worker("w1", concurrency=2)
    _warm(producer)
    tasks = [producer.hold.delay(f"solo:{i}", 0.05, note=f"solo{i}") for i in range(40)]
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start' AND note LIKE 'solo%'", 6, at_least=True)
    worker = cluster.workers["w1"]
    stop_at = cluster.scalar("SELECT extract(epoch FROM clock_timestamp())")
    os.kill(worker.pid, signal.SIGTERM)  # warm shutdown: the running bodies end, nothing new starts here
    worker.wait(timeout=60)
    left = cluster.rows("SELECT task_id, state, holder, claimed_at, lease_expires_at FROM keyed_claims")
    assert left == [], (left, cluster.logs["w1"].read_text()[-6000:])  # no slot held by a worker that is gone
    cluster.start_worker("w2", concurrency=2)
    assert sorted(r.get(timeout=120) for r in tasks) == sorted(f"solo{i}" for i in range(40))
    assert cluster.scalar("SELECT count(DISTINCT task_id) FROM observed WHERE note LIKE 'solo%'") == 40
    # Once each, but for Celery's own at-least-once at a warm shutdown: a job a pool process took as the shutdown
    # began, whose result the stopping worker never read (its message goes back unacked), runs again on w2 — never
    # beside itself (its claim went back only once w1's pool had stopped).
    twice = cluster.rows(
        "SELECT task_id, min(extract(epoch FROM at)) AS first FROM observed WHERE kind = 'start' AND note LIKE 'solo%'"
        " GROUP BY task_id HAVING count(*) > 1"
    )
    assert all(float(r.first) >= float(stop_at) for r in twice), (twice, stop_at)
    for i in range(40):
        assert peak_overlap(cluster.intervals(f"solo:{i}")) == 1
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0, timeout=30)
    assert cluster.scalar("SELECT coalesce(sum(used), 0) FROM keyed_slots") == 0
