"""Debounce per key (issue 14 item 2) with a real prefork worker, real Redis and real Postgres: a burst of calls of
a debounced task runs its body once, after the key has been quiet, with the last (or first) call's arguments; every
other call's result is a ``KeyedSuperseded`` failure, and the books balance."""

from __future__ import annotations

import time

import pytest

from celery_keyed import KeyedSuperseded
from tests.acceptance.conftest import Cluster


def _books(cluster: Cluster) -> dict[str, int]:
    rows = cluster.rows("SELECT coalesce(outcome, 'open') AS outcome, count(*) AS n FROM keyed_tasks GROUP BY 1")
    return {r.outcome: r.n for r in rows}


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_five_quick_calls_run_the_body_once_with_the_last_argument(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=2)
    cluster.wait_ready("w1")
    results = [producer.debounced.delay("search:1", str(i)) for i in range(5)]
    assert results[-1].get(timeout=30) == "4"  # after its quiet period (debounce=1.0)
    for result in results[:-1]:
        with pytest.raises(KeyedSuperseded):
            result.get(timeout=30)
    time.sleep(1.5)  # longer than the quiet period: nothing else starts
    starts = cluster.rows("SELECT task_id, note FROM observed WHERE kind = 'start'")
    assert [(r.task_id, r.note) for r in starts] == [(results[-1].id, "4")]
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome IS NULL", 0)
    assert _books(cluster) == {"superseded": 4, "completed": 1}


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_keep_first_runs_the_first_call_and_other_keys_debounce_apart(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=2)
    cluster.wait_ready("w1")
    first = [producer.debounced.apply_async(("search:1", str(i)), debounce_keep="first") for i in range(5)]
    other = [producer.debounced.delay("search:2", f"b{i}") for i in range(3)]
    plain = producer.debounced.apply_async(("search:3", "now"), debounce=None)  # not debounced for this call
    assert plain.get(timeout=30) == "now"
    assert first[0].get(timeout=30) == "0"
    assert other[-1].get(timeout=30) == "b2"
    for result in [*first[1:], *other[:-1]]:
        with pytest.raises(KeyedSuperseded):
            result.get(timeout=30)
    notes = sorted(r.note for r in cluster.rows("SELECT note FROM observed WHERE kind = 'start'"))
    assert notes == ["0", "b2", "now"]
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome IS NULL", 0)
    assert _books(cluster) == {"superseded": 6, "completed": 3}
