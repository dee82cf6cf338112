"""Rate windows with real workers: two prefork workers, real Redis and Postgres, the independent observer table.
A name with two windows (2 per second and 3 per 4 seconds) beside a gate: the ledger's starts of a key never put
more than N in any window of T for either window, the keys of the name are limited each on its own, and the windows
(not the gate) are what bound the run."""

from __future__ import annotations

import pytest

from tests.acceptance.conftest import Cluster, peak_overlap

WINDOWS = [(2, 1.0), (3, 4.0)]


@pytest.mark.parametrize("cluster", [{"quota": {"limit": 10, "windows": [list(w) for w in WINDOWS]}}], indirect=True)
def test_two_windows_bound_every_key_and_each_key_apart(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=3)
    cluster.start_worker("w2", concurrency=3)
    for i in range(6):
        for key in ("quota:a", "quota:b"):
            producer.hold.delay(key, 0.05, note=f"{key}-{i}")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", 12, timeout=60)
    # The windows bind the ledger's claims (the starts are taken when the slot is given): count those, as the ledger
    # timed them; a body starts a dispatch later, which is no part of the windows' promise.
    for key in ("quota:a", "quota:b"):
        starts = sorted(
            float(r.at)
            for r in cluster.rows(
                "SELECT extract(epoch FROM claimed_at) AS at FROM observed WHERE kind = 'start' AND key = :key",
                key=key,
            )
        )
        assert len(starts) == 6, (key, starts)
        for n, seconds in WINDOWS:
            for first in starts:
                inside = sum(1 for t in starts if first <= t < first + seconds)
                assert inside <= n, f"{key}: {inside} starts within {seconds}s from {first}"
        # Positions 0-1 start at once, 2 a second later, 3-4 when the first start is 4 s old, 5 a second after that.
        assert starts[-1] - starts[0] >= 5.0 - 0.05, (key, starts)
        assert peak_overlap(cluster.intervals(key)) <= 10
    # the two keys ran side by side: each key's windows are its own
    firsts = [
        float(cluster.scalar("SELECT min(extract(epoch FROM claimed_at)) FROM observed WHERE key = :key", key=k))
        for k in ("quota:a", "quota:b")
    ]
    assert abs(firsts[0] - firsts[1]) < 2.0
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
