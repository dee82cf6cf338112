"""Tasks of the fault tests (tests/acceptance/test_faults.py, test_partition.py): keys that fail on hostile arguments,
a keyed task that touches no database (it finishes while Postgres is down), and one that writes its own record to a
file (its worker may be cut off from the database)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from celery_keyed import keyed_task


def define(app: Any, ns: Any) -> None:
    @keyed_task(app=app, name="acceptance.fmt", concurrency_key="fmt:{n:05d}")
    def fmt(n: int) -> int:
        return n

    @keyed_task(app=app, name="acceptance.divide", concurrency_key=lambda n, **_: f"div:{1 // n}")
    def divide(n: int) -> int:
        return n

    @keyed_task(app=app, name="acceptance.nap", concurrency_key="{key}", acks_late=True)
    def nap(key: str, seconds: float) -> str:
        """Keyed, acks_late, and writes nowhere: it ends while the ledger is unreachable."""
        time.sleep(seconds)
        return "napped"

    def long_once(self: Any, key: str, seconds: float, log: str) -> str:
        """Writes its start, a stamp every 20 ms and its end to the file ``log`` (one JSON line each: an observer
        that needs no database). Long only the first time: a run that finds an earlier start of its own task id
        takes 0.1 s. At its start it notes the bodies of its key that started, never ended, and whose process still
        runs (``alive``): a second body of a mutex running beside it."""
        path = Path(log)
        seen = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        ended = {(r["id"], r["run"]) for r in seen if r["kind"] == "end"}
        starts = [r for r in seen if r["kind"] == "start" and r["key"] == key]
        run = sum(1 for r in starts if r["id"] == self.request.id) + 1
        alive = [r["pid"] for r in starts if (r["id"], r["run"]) not in ended and _running(r["pid"])]

        def write(kind: str, **extra: Any) -> None:
            record = {"kind": kind, "id": self.request.id, "key": key, "run": run, "pid": os.getpid()}
            record["at"] = time.time()
            with open(log, "a") as out:
                out.write(json.dumps({**record, **extra}) + "\n")

        write("start", alive=alive)
        until = time.monotonic() + (seconds if run == 1 else 0.1)
        while time.monotonic() < until:
            write("alive")
            time.sleep(0.02)
        write("end")
        return f"{key} run {run}"

    ns.fmt, ns.divide, ns.nap = fmt, divide, nap
    # Celery's defaults: the message is acked when the body starts, and a lost worker is not a reason to requeue.
    ns.long_once = keyed_task(
        app=app,
        name="acceptance.long_once",
        bind=True,
        concurrency_key="{key}",
        acks_late=False,
        reject_on_worker_lost=False,
    )(long_once)
    # acks_late, but not reject_on_worker_lost: Celery acks the message when the worker is lost.
    ns.long_once_late = keyed_task(
        app=app,
        name="acceptance.long_once_late",
        bind=True,
        concurrency_key="{key}",
        acks_late=True,
        reject_on_worker_lost=False,
    )(long_once)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a killed pool process its parent has not reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
