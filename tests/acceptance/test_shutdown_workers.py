"""Bodies that outlive the signal that asks them to stop, with real prefork workers, real Redis and real PostgreSQL:
a cold shutdown (SIGQUIT), a cancel on a lost broker connection, a hard time limit, a terminate. A slot goes back
only once the body has provably stopped — the pool reported its process's exit or its job's result — never when a
signal was merely sent.

The tasks (tests/acceptance/shutdown_tasks.py) handle SIGTERM with a cleanup and write their own start, ticks and end
into ``observed`` (the independent observer). Two workers consume different queues, so the task parked behind the
first one starts on the other worker, as soon as the ledger lets it (a local handoff on the first worker would wait
for its busy consumer loop and hide an early release)."""

from __future__ import annotations

import gc
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.exceptions import TimeLimitExceeded

from celery_keyed import KeyedCancelled
from celery_keyed.testing import RedisServer, start_redis
from tests.acceptance.conftest import Cluster, make_cluster, peak_overlap

CLEANUP = 3.0  # seconds a body's SIGTERM handler cleans up for


def _last_sign_of_life(cluster: Cluster, task_id: str) -> float:
    """When the body last wrote anything (its end, or the last tick of a cleanup cut short by SIGKILL)."""
    return float(cluster.scalar("SELECT extract(epoch FROM max(at)) FROM observed WHERE task_id = :id", id=task_id))


def _record(cluster: Cluster, task_id: str, since: float) -> str:
    rows = cluster.rows(
        "SELECT kind, note, extract(epoch FROM at) AS at FROM observed WHERE task_id = :id ORDER BY at", id=task_id
    )
    ticks = [r for r in rows if r.kind == "tick"]
    shown = [f"{r.kind} {r.note} {float(r.at) - since:+.3f}" for r in rows if r.kind != "tick"]
    if ticks:
        shown.append(f"{len(ticks)} ticks {float(ticks[0].at) - since:+.3f}..{float(ticks[-1].at) - since:+.3f}")
    return "; ".join(shown) + " (seconds after the second's start)"


def _first_start(cluster: Cluster, task_id: str) -> float:
    at = cluster.scalar(
        "SELECT extract(epoch FROM min(at)) FROM observed WHERE task_id = :id AND kind = 'start'", id=task_id
    )
    assert at is not None, f"{task_id} never started"
    return float(at)


def _books(cluster: Cluster, task_id: str, expected: str, timeout: float = 60.0) -> tuple[str, str]:
    cluster.wait_for("SELECT outcome FROM keyed_tasks WHERE task_id = :id", expected, timeout=timeout, id=task_id)
    row = cluster.rows("SELECT outcome, detail FROM keyed_tasks WHERE task_id = :id", id=task_id)[0]
    return row.outcome, row.detail or ""


def _one_running_one_parked(cluster: Cluster, producer: Any, task: Any, key: str, **options: Any) -> tuple[Any, Any]:
    """W1 runs ``task`` on ``key`` (its body handles SIGTERM with a cleanup of CLEANUP seconds); a plain task of the
    same key waits in the ledger behind it, received by W2 (the only consumer of its queue)."""
    cluster.start_worker("w1", concurrency=2, extra=["-Q", "only-w1"])
    cluster.start_worker("w2", concurrency=2, extra=["-Q", "only-w2"])
    first = task.apply_async((key, 60.0, CLEANUP), {"note": "first"}, queue="only-w1", **options)
    cluster.wait_for("SELECT count(*) FROM observed WHERE task_id = :id AND kind = 'start'", 1, id=first.id)
    second = producer.hold.apply_async((key, 0.1), {"note": "second"}, queue="only-w2")
    cluster.wait_for("SELECT count(*) FROM keyed_waiting WHERE task_id = :id", 1, id=second.id)
    return first, second


def _body_gone(cluster: Cluster, task_id: str, timeout: float = 60.0) -> None:
    """Wait until the pool process that ran the task's body is gone (exited; a zombie runs nothing either): only then
    is its record complete."""
    pid = cluster.scalar(
        "SELECT pid FROM observed WHERE task_id = :id AND kind = 'start' ORDER BY at LIMIT 1", id=task_id
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        assert time.monotonic() < deadline, f"the pool process {pid} of {task_id} still runs"
        time.sleep(0.05)


def _second_waited_for_the_first(cluster: Cluster, first: Any, second: Any, key: str) -> None:
    assert second.get(timeout=90) == "second"
    _body_gone(cluster, first.id)
    first_end, second_start = _last_sign_of_life(cluster, first.id), _first_start(cluster, second.id)
    assert second_start >= first_end, (
        f"the second started {first_end - second_start:.3f} s before the first body's last sign of life: "
        f"{_record(cluster, first.id, second_start)}"
    )
    assert peak_overlap(cluster.intervals(key)) == 1


def test_a_cold_shutdown_releases_only_after_the_body_has_cleaned_up(cluster: Cluster, producer: Any) -> None:
    """SIGQUIT (cold shutdown): Celery cancels the running task, which only *sends* SIGTERM to its pool process; the
    body cleans up for 3 s. The task parked behind it starts once the pool has reported the process's exit, not when
    the signal went out. acks_late and unacked, the message comes back: the task is admitted again and completes."""
    key = "shut:acks-late"
    first, second = _one_running_one_parked(cluster, producer, producer.cleanup, key)

    os.kill(cluster.workers["w1"].pid, signal.SIGQUIT)  # the main process only; Celery signals its pool processes
    _second_waited_for_the_first(cluster, first, second, key)
    assert (
        cluster.scalar(
            "SELECT note FROM observed WHERE task_id = :id AND kind = 'end' ORDER BY at LIMIT 1", id=first.id
        )
        == "cleaned up"
    )
    cluster.workers["w1"].wait(timeout=60)

    # Worker lost: its message was never acked, so the broker has it again, and a worker of its queue runs it.
    cluster.start_worker("w3", concurrency=2, extra=["-Q", "only-w1"])
    cluster.wait_for("SELECT count(*) FROM observed WHERE task_id = :id AND kind = 'start'", 2, id=first.id)
    os.kill(cluster.workers["w3"].pid, signal.SIGQUIT)  # the rerun (60 s) stopped the same way
    cluster.workers["w3"].wait(timeout=60)
    assert peak_overlap(cluster.intervals(key)) == 1
    assert _books(cluster, second.id, "completed")[0] == "completed"
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)


def test_a_hard_time_limit_releases_only_after_the_pool_process_exited(cluster: Cluster, producer: Any) -> None:
    """A hard time limit: billiard fails the job (its release), then sends SIGTERM, and SIGKILL 0.1 s later. The body
    handles SIGTERM and ticks through its cleanup until the SIGKILL. The parked task starts after the last tick: the
    slot goes back once the pool has reaped the process, not at the failure."""
    key = "shut:time-limit"
    # The limit falls well after the second is parked, even on a loaded machine.
    first, second = _one_running_one_parked(cluster, producer, producer.cleanup, key, time_limit=5)

    with pytest.raises(TimeLimitExceeded):
        first.get(timeout=60)
    _second_waited_for_the_first(cluster, first, second, key)
    assert cluster.scalar("SELECT count(*) FROM observed WHERE task_id = :id AND kind = 'end'", id=first.id) == 0
    assert _books(cluster, first.id, "failed")[0] == "failed"  # acks_on_timeout (Celery's default): failed for good
    assert _books(cluster, second.id, "completed")[0] == "completed"
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)


def test_a_cold_shutdown_of_a_task_acked_at_start_books_a_final_outcome(cluster: Cluster, producer: Any) -> None:
    """acks_late off: the message was acked when the task started, so nothing brings it back after a cold shutdown
    stops its body. Celery leaves its result at RETRY ("cancelled by Celery") for ever; the gate books it failed and
    stores a ``KeyedCancelled`` result, so ``get()`` returns and the books balance."""
    key = "shut:acked"
    first, second = _one_running_one_parked(cluster, producer, producer.cleanup_early_ack, key)

    os.kill(cluster.workers["w1"].pid, signal.SIGQUIT)
    _second_waited_for_the_first(cluster, first, second, key)
    with pytest.raises(KeyedCancelled):
        first.get(timeout=60)
    detail = _books(cluster, first.id, "failed")[1]
    assert "cold shutdown" in detail, detail
    assert _books(cluster, second.id, "completed")[0] == "completed"
    cluster.workers["w1"].wait(timeout=60)
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
    deadline = time.monotonic() + 10
    while cluster.scalar("SELECT count(*) FROM keyed_tasks WHERE outcome IS NULL") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.scalar("SELECT count(*) FROM keyed_tasks WHERE outcome IS NULL") == 0


def test_a_terminate_releases_only_after_the_body_has_cleaned_up(cluster: Cluster, producer: Any) -> None:
    """``revoke(terminate=True)``: Celery signals the pool process and records the revoke at once; the slot goes back
    when the pool reports the process's exit (a guard: this was already so)."""
    key = "shut:terminate"
    first, second = _one_running_one_parked(cluster, producer, producer.cleanup, key)

    producer.app.control.revoke(first.id, terminate=True)
    _second_waited_for_the_first(cluster, first, second, key)
    assert _books(cluster, first.id, "revoked")[0] == "revoked"
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis of this test's own, so it can be stopped."""
    server = start_redis(use_env=False, persistent=True)
    assert isinstance(server, RedisServer)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def outage_cluster(database_url: str, own_redis: RedisServer, redis_url: str, tmp_path: Path) -> Iterator[Cluster]:
    """The broker on ``own_redis``; the results on the session's Redis, which stays up (so Celery's cancel, which
    stores a RETRY result, goes through while the broker is away)."""
    for cluster in make_cluster(database_url, own_redis.url_for(0), tmp_path, {}):
        cluster.env.update(CELERY_RESULT_BACKEND=redis_url)
        yield cluster


@pytest.fixture
def outage_producer(outage_cluster: Cluster) -> Iterator[Any]:
    from celery_keyed.publisher import close_publisher
    from tests.acceptance.proj import make_app

    ns = make_app(outage_cluster.env)
    yield ns
    gc.collect()  # the results' unsubscribes, while their Redis runs (collected later, each raised at exit)
    close_publisher(ns.app)
    ns.app.close()


# Stopping Redis under the test process's own clients leaves their sockets to be collected later: not a finding.
@pytest.mark.filterwarnings("ignore::ResourceWarning", "ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_cancel_on_connection_loss_releases_only_after_the_body_has_cleaned_up(
    outage_cluster: Cluster, own_redis: RedisServer, outage_producer: Any
) -> None:
    """``worker_cancel_long_running_tasks_on_connection_loss``: the broker goes away for a second, Celery cancels the
    running acks_late task (SIGTERM to its pool process), whose body cleans up for 3 s. The parked task starts once
    the broker is back and the first body has ended, not when the signal went out."""
    cluster, producer = outage_cluster, outage_producer
    cluster.env.update(CANCEL_ON_CONNECTION_LOSS="1")
    key = "shut:connection-loss"
    first, second = _one_running_one_parked(cluster, producer, producer.cleanup, key)

    own_redis.suspend()
    deadline = time.monotonic() + 30
    while not cluster.scalar("SELECT count(*) FROM observed WHERE task_id = :id AND kind = 'term'", id=first.id):
        assert time.monotonic() < deadline, "the connection loss did not cancel the running task"
        time.sleep(0.05)
    own_redis.resume()
    _second_waited_for_the_first(cluster, first, second, key)
