"""What Celery's tools see: every outcome of a keyed task reaches a real event receiver (``app.events.Receiver``, as
Flower and ``celery events`` consume them), Celery's own state machine (``celery.events.state.State``, which Flower
and ``celery events`` keep their task list with) ends each task in the state of its result, and the gate's signals
fire."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

import pytest

from celery_keyed import KeyedRejected
from tests.acceptance.conftest import ROOT, Cluster


class Events:
    """A real event receiver on the cluster's broker, in a thread of the test process."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.state = app.events.State()  # as Flower keeps it
        self.states: dict[str, list[str]] = defaultdict(list)  # each task's state after each of its events
        self.ready = threading.Event()
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self.ready.wait(30), "the event receiver did not start"

    def _run(self) -> None:
        with self.app.connection_for_read() as conn:
            self._receiver = self.app.events.Receiver(conn, handlers={"*": self._on_event})
            self.ready.set()
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def _on_event(self, event: dict[str, Any]) -> None:
        self.state.event(event)
        if "uuid" in event:
            self.seen[event["uuid"]].append(event)
            task = self.state.tasks.get(event["uuid"])
            self.states[event["uuid"]].append(task.state if task is not None else "")

    def types(self, task_id: str) -> list[str]:
        return [e["type"] for e in self.seen.get(task_id, [])]

    def wait_for(self, task_id: str, event_type: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.seen.get(task_id, []):
                if event["type"] == event_type:
                    return event
            time.sleep(0.05)
        raise AssertionError(f"no {event_type} for {task_id}; seen {self.types(task_id)}")

    def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(timeout=10)


@pytest.mark.parametrize("cluster", [{"ev": {"limit": 1, "max_waiting": 2}}], indirect=True)
def test_every_outcome_reaches_a_celery_event_receiver(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=3, extra=["-E"])
    events = Events(producer.app)
    try:
        running = producer.hold.delay("ev:1", 3.0, note="running")
        events.wait_for(running.id, "task-started")
        parked = producer.hold.delay("ev:1", 0.1, note="parked")
        revoked = producer.hold.delay("ev:1", 0.1, note="revoked")
        assert events.wait_for(parked.id, "keyed-parked")["key"] == "ev:1"
        events.wait_for(revoked.id, "keyed-parked")
        assert events.states[parked.id][-1] == "RECEIVED"  # waiting: received, as far as Celery's states go
        rejected = producer.hold.delay("ev:1", 0.1, note="rejected")  # the waiting room (2) is full
        event = events.wait_for(rejected.id, "task-rejected")
        assert event["keyed_outcome"] == "rejected" and event["requeue"] is False
        assert "KeyedRejected" in events.wait_for(rejected.id, "task-failed")["exception"]  # its result

        producer.app.control.revoke(revoked.id)
        assert events.wait_for(revoked.id, "task-revoked")["keyed_outcome"] == "revoked"
        expiring = producer.hold.apply_async(("ev:1", 0.1), {"note": "expiring"}, expires=1.0)
        events.wait_for(expiring.id, "keyed-parked")
        event = events.wait_for(expiring.id, "task-revoked")
        assert event["keyed_outcome"] == "expired" and event["expired"] is True

        assert events.wait_for(parked.id, "keyed-promoted")["key"] == "ev:1"
        events.wait_for(parked.id, "task-succeeded")
        assert events.types(parked.id).count("task-received") == 1, events.types(parked.id)  # handed over here
        assert events.types(parked.id).count("task-started") == 1
        assert parked.get(timeout=30) == "parked"
        # What Flower shows: each task ends in the state of its result, never "received" or a state of the gate's.
        finals = {parked.id: "SUCCESS", revoked.id: "REVOKED", expiring.id: "REVOKED", rejected.id: "FAILURE"}
        for task_id, final in finals.items():
            assert events.states[task_id][-1] == final, (events.types(task_id), events.states[task_id])
        assert "STARTED" in events.states[parked.id]  # it showed as started while it ran after its wait
    finally:
        events.stop()


def test_the_gate_sends_its_signals_and_debug_logs(cluster: Cluster, producer) -> None:
    """The signals fire in the worker's main process: a receiver connected there (tests/acceptance/proj.py
    connects one that logs each signal) sees parked, promoted and rejected."""
    cluster.env.update(KEYED_LOG_SIGNALS="1")
    cluster.start_worker("w1", concurrency=2, extra=["-l", "DEBUG"])
    first = producer.hold.delay("sig:1", 1.0, note="first")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start'", 1)
    second = producer.hold.delay("sig:1", 0.1, note="second")
    bad = producer.app.send_task("acceptance.fmt", args=["abc"])
    assert second.get(timeout=30) == "second" and first.get(timeout=30) == "first"
    with pytest.raises(KeyedRejected):
        bad.get(timeout=30)
    log = cluster.logs["w1"].read_text(errors="replace")
    assert f"signal keyed_parked {second.id} sig:1" in log
    assert f"signal keyed_promoted {second.id} sig:1" in log
    assert f"signal keyed_rejected {bad.id}" in log
    assert f"acceptance.hold[{second.id}] parked in the line of sig:1" in log  # the DEBUG log


def test_keyed_inspect_shows_what_each_gate_holds(cluster: Cluster, producer) -> None:
    """``celery -A proj keyed inspect``: through Celery's remote control, each worker's running attempts."""
    import json
    import subprocess
    import sys

    cluster.start_worker("w1", concurrency=2)
    running = producer.hold.delay("insp:1", 30.0, note="running")
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'start'", 1)
    cmd = [sys.executable, "-m", "celery", "-A", "tests.acceptance.proj", "keyed", "inspect", "--timeout", "3"]
    # The main process learns that the pool process accepted the task a moment after the body starts (longer
    # on a loaded machine): ask again until it says so.
    deadline = time.monotonic() + 60
    while True:
        out = subprocess.run([*cmd, "--json"], cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        replies = json.loads(out.stdout)
        workers = [w for w in replies if w.startswith("w1@")]
        running_rows = [(r["task_id"], r["key"], r["started"]) for w in workers for r in replies[w]["running"]]
        if running_rows == [(running.id, "insp:1", True)] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert running_rows == [(running.id, "insp:1", True)], out.stdout
    assert replies[workers[0]]["ledger_reachable"] is True
    text = subprocess.run(cmd, cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=60)
    assert text.returncode == 0 and running.id in text.stdout and "insp:1" in text.stdout, text.stdout + text.stderr
