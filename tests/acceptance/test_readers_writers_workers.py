"""Readers and writers per key with real workers (issue 14 item 6): two prefork workers, real Redis, real Postgres and
the independent observer (the ``observed`` table the tasks write). A stream of shared tasks and a few exclusive ones
on one key with K = 3: at most 3 at once, no exclusive task overlaps anything of its key, and every exclusive task
ran before the readers published after it had arrived."""

from __future__ import annotations

import pytest

from tests.acceptance.conftest import Cluster, peak_overlap

SERVICE = 0.2


@pytest.mark.parametrize("cluster", [{"doc": 3}], indirect=True)
def test_writers_run_alone_and_are_not_starved_by_readers(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=3)
    cluster.start_worker("w2", concurrency=3)
    rounds = 3
    readers: list[list[str]] = []  # readers[i]: the task ids published after writer i - 1 and before writer i
    writers: list[str] = []
    for r in range(rounds + 1):
        readers.append([producer.hold.delay("doc:1", SERVICE, note=f"r{r}-{i}").id for i in range(8)])
        if r == rounds:
            break
        w = producer.hold.apply_async(("doc:1", SERVICE), {"note": f"w{r}"}, concurrency_mode="exclusive").id
        writers.append(w)
        # The writer has reached the ledger (admitted or parked) before the next readers are published.
        cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE task_id = :t", 1, timeout=30, t=w)
    total = 8 * (rounds + 1) + rounds
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", total, timeout=120)

    spans = {task_id: (start, end) for task_id, start, end in cluster.intervals("doc:1")}
    assert len(spans) == total
    assert peak_overlap(cluster.intervals("doc:1")) <= 3
    assert peak_overlap([(t, *spans[t]) for group in readers for t in group]) >= 2  # readers ran together
    for i, w in enumerate(writers):
        ws, we = spans[w]
        overlapping = [t for t, (s, e) in spans.items() if t != w and s < we and e > ws]
        assert overlapping == [], f"exclusive task {i} overlapped {overlapping}"
        later = [t for group in readers[i + 1 :] for t in group]
        early = [t for t in later if spans[t][0] < we]
        assert early == [], f"readers published after exclusive task {i} started before it ended: {early}"
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
    cluster.wait_for("SELECT coalesce(sum(used), 0) FROM keyed_slots", 0)
    books = dict(cluster.rows("SELECT coalesce(outcome, 'open'), count(*) FROM keyed_tasks GROUP BY 1"))
    assert books == {"completed": total}
