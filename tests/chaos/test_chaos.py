"""The chaos harness (tests/chaos/harness.py) under pytest: a short variant in the fast suite (<= 90 s), the
long one with ``make chaos`` (marked slow). The seed comes from ``CHAOS_SEED`` when set (to replay a run), else
a fixed one for the short variant and a fresh one for the long; the schedule and the figures are printed
(``pytest -s``), and the report is attached to the failure message."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.harness import Report, long_config, run, short_config

SHORT_SEED = 9


def _seed(default: int | None) -> int:
    if os.environ.get("CHAOS_SEED"):
        return int(os.environ["CHAOS_SEED"])
    return default if default is not None else random.SystemRandom().randrange(10**6)


def _verdict(report: Report) -> None:
    assert not report.failures, "\n" + report.text()


# The harness stops Redis and PostgreSQL under its own clients: their sockets are collected later.
_BROKEN_SOCKETS = pytest.mark.filterwarnings(
    "ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning"
)


@_BROKEN_SOCKETS
@pytest.mark.timeout(180)
def test_chaos_short(tmp_path: Path) -> None:
    """A few hundred tasks; a warm shutdown mid-task longer than the lease, a pool child SIGKILL, a main process
    SIGKILL, a Redis outage longer than the lease, a PostgreSQL restart, a cold shutdown, a silent network between
    a worker and PostgreSQL, and a reshard while readers and writers run."""
    _verdict(run(short_config(_seed(SHORT_SEED)), tmp_path))


@_BROKEN_SOCKETS
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_chaos_long(tmp_path: Path) -> None:
    """``make chaos``: a few thousand tasks over about five minutes, every fault kind three times."""
    _verdict(run(long_config(_seed(None)), tmp_path))


def test_only_unseen_tasks_published_before_a_redis_stop_count_as_lost_by_the_broker(tmp_path: Path) -> None:
    """The harness excuses a missing task only when the Redis transport can have lost it (published before a
    Redis stop, never in the ledger, never received by a worker); any other missing task stays a failure."""
    from tests.chaos.harness import Chaos

    run = Chaos.__new__(Chaos)
    run.tasks = {t: ("m:1", 0.1, i) for i, t in enumerate(["before", "after", "received", "booked", "unpublished"])}
    run.published_at = {"before": 10.0, "after": 30.0, "received": 10.0, "booked": 10.0}
    run.redis_stops = [20.0]
    run.main_kills = []
    run.logdir = tmp_path
    (tmp_path / "a1.0.log").write_text("Task chaos.work[received] received\n")
    assert run.broker_lost({"booked": "completed"}) == ["before"]


def test_the_observer_finds_a_writer_beside_its_key_and_readers_over_k() -> None:
    """The readers-and-writers check, on made-up records: a writer that overlaps a reader of its key (and not one of
    another key) is a definite overlap; one that overlaps only inside a killed body's uncertain end is ambiguous;
    a fourth reader beside three is over K = 3; bodies that touch end to start do not overlap."""
    from tests.chaos.harness import Body, overlaps, writer_overlaps

    def body(task_id: str, key: str, start: float, end: float | None, **dead: Any) -> Body:
        return Body(task_id, key, 1, 1, "w@h", start, end, **dead)

    bodies = [
        body("w1", "doc:0", 0.0, 1.0),
        body("r1", "doc:0", 0.5, 1.5),  # beside w1
        body("r2", "doc:1", 0.5, 1.5),  # another key
        body("w2", "doc:0", 2.0, 3.0),
        body("r3", "doc:0", 1.5, None, last_alive=1.9, death=2.2),  # killed: ended between 1.9 and 2.2
        body("r4", "doc:0", 3.0, 3.5),  # starts as w2 ends
    ]
    found = writer_overlaps(bodies, {"w1", "w2"})
    assert [({b.task_id for b in o.bodies}, o.definite) for o in found] == [({"w1", "r1"}, True), ({"r3", "w2"}, False)]
    readers = [body(f"r{i}", "doc:0", 0.1 * i, 1.0) for i in range(4)]
    peaks, over = overlaps(readers, {"doc:0": 3})
    assert peaks == {"doc:0": 4} and [o.definite for o in over] == [True]
    assert overlaps(readers[:3], {"doc:0": 3})[1] == []
