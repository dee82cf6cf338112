"""Books lost with a failover, workers lost with it (D20): the standby falls behind, tasks run and finish on the old
primary, then the workers and the primary are SIGKILLed together and the standby is promoted. Nothing that survives
knows those tasks but the result backend: the reconciler books each from its result, once, and the books balance."""

from __future__ import annotations

import time
from typing import Any

import pytest

from celery_keyed import beat, lost_books
from tests.acceptance.test_failover_workers import KEYS, Failover, _books_balance
from tests.acceptance.test_failover_workers import failover as failover  # the fixture
from tests.acceptance.test_failover_workers import producer as producer  # the fixture
from tests.acceptance.test_failover_workers import pytestmark as pytestmark  # needs pg_basebackup


@pytest.fixture(autouse=True)
def extended_results(failover: Failover) -> None:
    failover.cluster.env["CELERY_RESULT_EXTENDED"] = "1"  # the task's name and arguments tell its key


def test_tasks_whose_workers_died_with_the_primary_are_booked_from_their_results(
    failover: Failover, producer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = failover.cluster
    producer.app.conf.result_extended = True
    cluster.start_worker("w1", concurrency=3)
    cluster.start_worker("w2", concurrency=3)
    before = [producer.hold.delay(KEYS[i % len(KEYS)], 0.05, note=f"before-{i}") for i in range(10)]
    assert sorted(r.get(timeout=120) for r in before) == sorted(f"before-{i}" for i in range(10))
    failover.standby.wait_caught_up()
    failover.standby.detach()  # from now on the primary's commits are lost with it
    lost = [producer.hold.delay(KEYS[i % len(KEYS)], 0.05, note=f"lost-{i}") for i in range(20)]
    assert sorted(r.get(timeout=120) for r in lost) == sorted(f"lost-{i}" for i in range(20))
    for name in ("w1", "w2"):  # the workers die with the primary: no journal survives
        cluster.kill_worker(name)
    failover.crash_and_promote()
    assert failover.ledger_scalar("SELECT count(*) FROM keyed_tasks WHERE outcome = 'completed'") < 30

    monkeypatch.setattr(beat, "_last_unreachable", float("-inf"))
    monkeypatch.setattr(lost_books, "_settled", set())
    deadline = time.monotonic() + 120
    sql = "SELECT count(*) FROM keyed_tasks WHERE outcome = 'completed'"
    while failover.ledger_scalar(sql) != 30:  # after the hold, and (a claim left running) after the reaper's wait
        assert time.monotonic() < deadline, f"{failover.ledger_scalar(sql)} completed in the books, 30 ran"
        beat.reconcile(producer.app)
        time.sleep(0.5)
    assert failover.ledger_scalar("SELECT count(*) FROM keyed_events WHERE kind = 'failover'") == 1
    beat.reconcile(producer.app)  # settled once: a later run books nothing twice
    _books_balance(failover, 30)
