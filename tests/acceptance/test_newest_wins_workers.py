"""Newest wins (issue 14 item 1) with real workers, real Redis, real Postgres and the independent observer (the
``observed`` table the tasks write, including from the SIGTERM handler of a terminated pool process): a long render of
a document is cancelled by a newer render of the same document, recorded ``superseded`` (its result a
``KeyedSuperseded`` failure), the newest runs, and never two renders of the key at once."""

from __future__ import annotations

import pytest

from celery_keyed import KeyedSuperseded
from tests.acceptance.conftest import Cluster, peak_overlap


def _books(cluster: Cluster) -> dict[str, int]:
    rows = cluster.rows("SELECT coalesce(outcome, 'open') AS outcome, count(*) AS n FROM keyed_tasks GROUP BY 1")
    return {r.outcome: r.n for r in rows}


def _newest_wins(cluster: Cluster, producer, *, stopped_as: str) -> None:
    old = producer.render.delay("doc:1", "report-7", 60.0, note="old")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start' AND task_id = :t", 1, timeout=30, t=old.id)
    other = producer.render.delay("doc:1", "report-8", 0.2, note="other")  # another document: waits its turn
    new = producer.render.delay("doc:1", "report-7", 0.3, note="new")
    assert new.get(timeout=60) == "new"
    with pytest.raises(KeyedSuperseded):
        old.get(timeout=30)
    assert other.get(timeout=30) == "other"
    ends = {r.task_id: r.note for r in cluster.rows("SELECT task_id, note FROM observed WHERE kind = 'end'")}
    assert ends == {old.id: stopped_as, new.id: "new", other.id: "other"}
    spans = {task_id: (start, end) for task_id, start, end in cluster.intervals("doc:1")}
    assert spans[old.id][1] - spans[old.id][0] < 30  # stopped, not run to its end
    assert peak_overlap(cluster.intervals("doc:1")) == 1  # never two at once on the mutex key
    assert spans[new.id][0] >= spans[old.id][1]
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome IS NULL", 0)
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
    cluster.wait_for("SELECT coalesce(sum(used), 0) FROM keyed_slots", 0)
    assert _books(cluster) == {"superseded": 1, "completed": 2}
    detail = cluster.scalar("SELECT detail FROM keyed_tasks WHERE task_id = :t", t=old.id)
    assert detail == f"superseded by {new.id} (newest wins)"


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_prefork_terminates_the_running_one(cluster: Cluster, producer) -> None:
    """Two prefork workers: the newest may be admitted by the worker that does not hold the old one (the keyed_cancel
    broadcast, else the holder's heartbeat, passes the request on); its pool process is terminated."""
    cluster.start_worker("w1", concurrency=2)
    cluster.start_worker("w2", concurrency=2)
    _newest_wins(cluster, producer, stopped_as="terminated")


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_threads_pool_the_task_polls_keyed_cancelled(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=2, extra=["-P", "threads"])
    _newest_wins(cluster, producer, stopped_as="cancelled")
