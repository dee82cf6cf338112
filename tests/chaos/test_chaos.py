"""The chaos harness (tests/chaos/harness.py) under pytest: a short variant in the fast suite (<= 90 s), the
long one with ``make chaos`` (marked slow). The seed comes from ``CHAOS_SEED`` when set (to replay a run), else
a fixed one for the short variant and a fresh one for the long; the schedule and the figures are printed
(``pytest -s``), and the report is attached to the failure message."""

from __future__ import annotations

import os
import random
from pathlib import Path

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
    SIGKILL, a Redis outage longer than the lease and a PostgreSQL restart."""
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
