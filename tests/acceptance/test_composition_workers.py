"""Composition with real workers (issue 4): several keys per task, weighted slots, protected capacity, early
release, a retry under a new key, per-link keys in a chain, uncertain holds. Two prefork workers, real Redis,
real Postgres, the independent observer table."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
from celery import chain

from tests.acceptance.conftest import Cluster, peak_overlap

SERVICE = 0.2


@pytest.mark.parametrize("cluster", [{"tenant": 2, "stripe": 5}], indirect=True)
def test_per_tenant_and_global_limits_together(cluster: Cluster, producer) -> None:
    """Per tenant K = 2 and a global K = 5: no tenant ever has 3 in flight, the total never 6, and both bounds
    are reached under load."""
    cluster.start_worker("w1", concurrency=4)
    cluster.start_worker("w2", concurrency=4)
    # Three service units each: on a loaded machine a handoff can take a good part of one unit, and the global
    # bound is only reached when five run at once.
    for i in range(8):
        for tenant in "abcd":
            producer.tenant_call.delay(tenant, 3 * SERVICE)
        _ = i
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", 32, timeout=90)
    per_tenant = {t: peak_overlap(cluster.intervals(f"tenant:{t}")) for t in "abcd"}
    assert max(per_tenant.values()) == 2, per_tenant
    assert peak_overlap(cluster.intervals()) == 5
    # every body has ended; each release runs just after its result is stored: wait for the last ones
    cluster.wait_for("SELECT coalesce(sum(used), 0) FROM keyed_slots", 0)
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)


@pytest.mark.parametrize("cluster", [{"api": 10}], indirect=True)
def test_a_cost_5_task_never_starts_while_more_than_5_of_10_are_taken(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=4)
    cluster.start_worker("w2", concurrency=4)
    for i in range(6):
        producer.hold.delay("api:x", 4 * SERVICE, note=f"light{i}")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start'", 6, timeout=30)
    heavy = producer.hold.apply_async(("api:x", SERVICE), {"note": "heavy"}, concurrency_cost=5)
    # FIFO is by receipt at the ledger (D10): send the light ones once the heavy one is in line
    cluster.wait_for("SELECT count(*) FROM keyed_waiting WHERE task_id = :id", 1, timeout=30, id=heavy.id)
    for i in range(4):
        producer.hold.delay("api:x", SERVICE, note=f"after{i}")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", 11, timeout=60)
    rows = cluster.rows(
        "SELECT kind, note, extract(epoch FROM at) AS at FROM observed WHERE kind IN ('start', 'end') ORDER BY at"
    )
    weight = {r.note: (5 if r.note == "heavy" else 1) for r in rows}
    in_use, peak, heavy_started_with = 0, 0, None
    for r in rows:
        if r.kind == "start" and r.note == "heavy":
            heavy_started_with = in_use
        in_use += weight[r.note] if r.kind == "start" else -weight[r.note]
        peak = max(peak, in_use)
    assert heavy_started_with is not None and heavy_started_with <= 5
    assert peak <= 10
    # Strict order (D10: by receipt at the ledger): the light tasks sent after the heavy one were not admitted
    # before it. The ledger's order is the fences' (taken under the key's slot lock); the moments the bodies
    # start may differ by the dispatch of each promotion (two workers, each promotion started where its slot
    # was freed), which is not an order the ledger promises.
    fences = {r.note: r.fence for r in cluster.rows("SELECT note, fence FROM observed WHERE kind = 'start'")}
    assert all(fences["heavy"] < fences[f"after{i}"] for i in range(4)), fences


@pytest.mark.parametrize("cluster", [{"stripe": 10, "stripe-optional": 7}], indirect=True)
def test_protected_capacity_essential_work_always_has_room(cluster: Cluster, producer) -> None:
    """Optional work takes ["stripe-optional", "stripe"], essential work ["stripe"]: while optional work floods,
    essential work starts at once."""
    cluster.start_worker("w1", concurrency=8)
    cluster.start_worker("w2", concurrency=8)
    for i in range(20):
        producer.hold.apply_async(
            ("optional", 6 * SERVICE), {"note": f"opt{i}"}, concurrency_key=["stripe-optional", "stripe"]
        )
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start'", 7, timeout=30)
    sent = time.time()
    for i in range(3):
        producer.hold.apply_async(("essential", SERVICE), {"note": f"ess{i}"}, concurrency_key="stripe")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end' AND key = 'essential'", 3, timeout=30)
    essential_starts = [
        float(r.at)
        for r in cluster.rows(
            "SELECT extract(epoch FROM at) AS at FROM observed WHERE kind = 'start' AND key = 'essential'"
        )
    ]
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", 23, timeout=60)
    # Measured against the optional work, not the clock (a loaded machine stretches the way to the ledger): every
    # essential task started before any of the optional tasks running when it was sent had ended, i.e. without
    # waiting for a slot the optional work held.
    first_optional_end = min(
        float(r.at)
        for r in cluster.rows(
            "SELECT extract(epoch FROM at) AS at FROM observed WHERE kind = 'end' AND key = 'optional'"
        )
    )
    assert max(essential_starts) < first_optional_end, (
        f"essential work waited behind optional work: {max(essential_starts) - sent:.2f}s after it was sent, "
        f"{max(essential_starts) - first_optional_end:.2f}s after an optional task ended"
    )
    assert peak_overlap(cluster.intervals("optional")) == 7


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_release_concurrency_lets_the_next_task_start_early(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=2)
    cluster.start_worker("w2", concurrency=2)
    first = producer.early.delay("acct:5", SERVICE, 6 * SERVICE)
    time.sleep(0.05)
    producer.hold.delay("acct:5", SERVICE, note="next")
    assert first.get(timeout=30) is True
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end' AND note = 'next'", 1, timeout=30)
    rows = {(r.kind, r.note): float(r.at) for r in cluster.rows(
        "SELECT kind, note, extract(epoch FROM at) AS at FROM observed"
    )}
    # the next task of the key ran while the first was still in its unkeyed part
    assert rows[("start", "next")] < rows[("end", "unkeyed")]
    assert peak_overlap(cluster.intervals("acct:5")) == 1  # the keyed parts never overlapped
    cluster.wait_for("SELECT outcome FROM keyed_tasks WHERE task_id = :id", "completed", timeout=10, id=first.id)


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_a_retry_is_admitted_under_its_new_key(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=2)
    blocker = producer.hold.delay("acct:new", 10 * SERVICE, note="blocker")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start' AND note = 'blocker'", 1, timeout=30)
    result = producer.rekey.delay("acct:old", "acct:new")
    assert result.get(timeout=30) == "acct:new"
    rows = {(r.kind, r.note): float(r.at) for r in cluster.rows(
        "SELECT kind, note, extract(epoch FROM at) AS at FROM observed"
    )}
    assert rows[("start", "retry")] >= rows[("end", "blocker")]  # it waited for the new key, not the old one
    assert cluster.scalar("SELECT key FROM keyed_tasks WHERE task_id = :id", id=result.id) == "acct:old"
    blocker.get(timeout=30)


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_each_link_of_a_chain_carries_its_own_key(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=2)
    cluster.start_worker("w2", concurrency=2)
    result = chain(
        producer.hold.si("link:1", SERVICE, note="one"),
        producer.hold.si("link:2", SERVICE, note="two"),
        producer.hold.si("link:1", SERVICE, note="three"),
    ).apply_async()
    assert result.get(timeout=30) == "three"
    keys = defaultdict(list)
    for r in cluster.rows("SELECT key, task_name FROM keyed_tasks ORDER BY arrived_at"):
        keys[r.task_name].append(r.key)
    assert keys["acceptance.hold"] == ["link:1", "link:2", "link:1"]


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_uncertain_hold_keeps_the_slot_after_a_hard_time_limit(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=2)
    stuck = producer.stuck_call.delay("bank:1")
    cluster.wait_for("SELECT count(*) FROM observed WHERE note = 'stuck'", 1, timeout=30)
    producer.hold.delay("bank:1", 0.05, note="next")
    with pytest.raises(Exception, match=r"TimeLimitExceeded|Time limit"):
        stuck.get(timeout=30)
    killed_at = time.time()
    cluster.wait_for("SELECT count(*) FROM keyed_claims WHERE state = 'uncertain'", 1, timeout=10)
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end' AND note = 'next'", 1, timeout=30)
    next_start = float(
        cluster.scalar("SELECT extract(epoch FROM at) FROM observed WHERE kind = 'start' AND note = 'next'")
    )
    assert next_start - killed_at > 1.2, "the next call started while the hung one's slot should have been held"
    assert cluster.scalar("SELECT outcome FROM keyed_tasks WHERE task_id = :id", id=stuck.id) == "failed"


@pytest.mark.parametrize("cluster", [{"api": {"limit": 10, "rate": "6/s", "burst": 1}}], indirect=True)
def test_a_rate_with_a_gate_never_exceeds_either(cluster: Cluster, producer) -> None:
    """A "6/s" rate with K = 10: starts in any window of t seconds never above 6·t + burst, in flight never
    above 10 (and the rate, not the gate, is what binds)."""
    cluster.start_worker("w1", concurrency=6)
    cluster.start_worker("w2", concurrency=6)
    for i in range(24):
        producer.hold.delay("api:x", 0.05, note=str(i))
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", 24, timeout=60)
    # The rate binds the ledger's claims (a token is taken when the slot is given): count those, as the ledger
    # timed them. The moments the bodies start add each promotion's dispatch (a few ms, more on a loaded
    # machine), which is no part of the rate's promise.
    starts = sorted(
        float(r.at)
        for r in cluster.rows("SELECT extract(epoch FROM claimed_at) AS at FROM observed WHERE kind = 'start'")
    )
    assert len(starts) == 24
    for i, first in enumerate(starts):
        for window in (0.5, 1.0, 2.0):
            inside = sum(1 for t in starts[i:] if t - first <= window)
            assert inside <= 6 * window + 1 + 1e-9, f"{inside} starts within {window}s"
    assert peak_overlap(cluster.intervals("api:x")) <= 10
    assert starts[-1] - starts[0] >= (24 - 1 - 1) / 6 - 0.3  # the rate really bound the run


@pytest.mark.parametrize("cluster", [{"stripe": {"limit": 2, "fair": True}}], indirect=True)
def test_fair_sharing_a_late_tenant_starts_within_a_service_time(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=2)
    cluster.start_worker("w2", concurrency=2)
    for i in range(30):
        producer.hold.apply_async(("stripe", SERVICE), {"note": f"A{i}"}, fair_key="tenant:A")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start'", 2, timeout=30, at_least=True)
    b_ids = [
        producer.hold.apply_async(("stripe", SERVICE), {"note": f"B{i}"}, fair_key="tenant:B").id for i in range(3)
    ]
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end' AND note LIKE 'B%'", 3, timeout=60)
    # Counted from the moment B's three tasks were in line at the ledger (its clock and the observer's are this
    # machine's), not from their publication: on a loaded machine the way from the broker to the ledger takes a
    # while, and A's promotions go on meanwhile. From then the slots' two promotions in flight may still be A's.
    sent = max(
        float(r.at)
        for r in cluster.rows(
            "SELECT extract(epoch FROM arrived_at) AS at FROM keyed_tasks WHERE task_id = ANY(:ids)", ids=b_ids
        )
    )
    b_starts = sorted(
        float(r.at)
        for r in cluster.rows(
            "SELECT extract(epoch FROM at) AS at FROM observed WHERE kind = 'start' AND note LIKE 'B%'"
        )
    )
    # Counted in starts, not seconds (a loaded machine stretches every service time): without fair sharing B
    # waits behind A's 28 parked tasks; with it B takes the next freed slot and alternates with A.
    a_starts = [
        float(r.at)
        for r in cluster.rows(
            "SELECT extract(epoch FROM at) AS at FROM observed WHERE kind = 'start' AND note LIKE 'A%'"
        )
    ]
    a_before = [sum(1 for a in a_starts if sent < a < b) for b in b_starts]
    assert a_before[0] <= 2, f"B's first task waited behind A's backlog: {a_before[0]} of A's started first"
    assert a_before[-1] <= 5, f"B's tasks did not alternate with A's: {a_before}"
    assert peak_overlap(cluster.intervals("stripe")) == 2
