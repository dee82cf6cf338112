"""A cap with borrowing, with real workers: two prefork workers, real Redis and Postgres, the independent observer
table. A name of limit 1 per key and cap 4 with borrowing: one busy key runs 4 at once while nobody else needs the
room; once other keys' tasks wait for the cap, the slots that come back go to them before the busy key's own
waiting tasks (which arrived earlier); the name's keys together never run more than 4."""

from __future__ import annotations

import pytest

from tests.acceptance.conftest import Cluster, peak_overlap


@pytest.mark.parametrize("cluster", [{"tenant": {"limit": 1, "cap": 4, "borrow": True}}], indirect=True)
def test_a_busy_key_borrows_the_idle_cap_and_gives_it_back_to_a_waiting_key(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=4)
    cluster.start_worker("w2", concurrency=4)
    # Holds of different lengths, so that tenant:a's slots come back one by one, 0.5 s apart: a slot that comes back
    # is then given in its own transaction, and the order of the ledger's claims is the order of its decisions. (With
    # equal holds the releases raced; two claims committed in one order can carry claimed_at — each transaction's
    # start — in the other, microseconds apart.)
    for i in range(6):
        producer.hold.delay("tenant:a", 2.0 + 0.5 * i, note=f"a{i}")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start'", 4, timeout=30)
    for other in ("b", "c"):  # two other keys (each of limit 1 too: both wait for the cap)
        producer.hold.delay(f"tenant:{other}", 0.3, note=other)
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", 8, timeout=60)
    assert peak_overlap(cluster.intervals("tenant:a")) == 4  # limit 1, borrowed up to the cap
    everyone = cluster.intervals("tenant:a") + cluster.intervals("tenant:b") + cluster.intervals("tenant:c")
    assert peak_overlap(everyone) <= 4  # the cap: the name's keys together
    # The ledger's order of starts (claimed_at): tenant:b and tenant:c before tenant:a's last two, although those two
    # were published first — tenant:a took no more past its own limit while the others waited for the cap. Had it
    # borrowed a slot while they waited, its claim would come a whole release (about 0.5 s) before theirs.
    claimed = {
        r.note: float(r.at)
        for r in cluster.rows("SELECT note, extract(epoch FROM claimed_at) AS at FROM observed WHERE kind = 'start'")
    }
    a_late = sorted(claimed[f"a{i}"] for i in range(6))[4:]
    assert max(claimed["b"], claimed["c"]) <= min(a_late), claimed
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
    cluster.wait_for("SELECT COALESCE(sum(used), 0) FROM keyed_slots WHERE key = 'tenant#cap'", 0)
