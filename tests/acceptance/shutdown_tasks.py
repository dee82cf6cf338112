"""Tasks of the shutdown tests (tests/acceptance/test_shutdown_workers.py): bodies that outlive the signal that asks
them to stop. Each handles SIGTERM with a cleanup of its own length, and writes its own record into ``observed`` (the
independent observer) on one connection opened before the handler can fire: ``start``; then, once SIGTERM came,
``term`` and a ``tick`` every few milliseconds for as long as the cleanup runs (a body SIGKILLed in its cleanup, as a
hard time limit does 0.1 s after its SIGTERM, leaves its last tick as the latest moment it is known to have run); and
``end`` when it is done (its note ``cleaned up`` after a cleanup, then the process exits). Each row carries the body's
own clock, read before the row is sent."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import psycopg

from celery_keyed import keyed_task

#: Seconds between two ticks of a cleanup.
TICK = 0.005


def define(app: Any, ns: Any) -> None:
    def body(task: Any, key: str, seconds: float, cleanup: float, note: str) -> str:
        task_id = task.request.id
        conn = psycopg.connect(ns.dsn, autocommit=True)

        def observe(kind: str, what: str = note) -> None:
            # The body's own clock, read before the row is sent: the body was running then (a row the server
            # writes later, after a SIGKILL cut the body, would otherwise carry a time the body never saw).
            conn.execute(
                "INSERT INTO observed (kind, task_id, key, note, pid, at)"
                " VALUES (%s, %s, %s, %s, %s, to_timestamp(%s))",
                (kind, task_id, key, what, os.getpid(), time.time()),
            )

        cleaning: list[bool] = []

        def cleaned_up(signum: int, frame: Any) -> None:
            if cleaning:  # a second SIGTERM: the cleanup already runs (the connection is not reentrant)
                return
            cleaning.append(True)
            observe("term")
            deadline = time.monotonic() + cleanup
            while time.monotonic() < deadline:
                observe("tick")
                time.sleep(TICK)
            observe("end", "cleaned up")
            os._exit(128 + signum)

        # A prefork pool process runs the task in its main thread (the only one that may set a signal handler).
        in_pool_process = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, cleaned_up) if in_pool_process else signal.SIG_DFL
        try:
            observe("start")
            time.sleep(seconds)
            observe("end")
            return note
        finally:
            if in_pool_process:
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
            conn.close()

    @keyed_task(app=app, name="acceptance.cleanup", bind=True, concurrency_key="{key}", acks_late=True)
    def cleanup(self: Any, key: str, seconds: float, cleanup: float, note: str = "") -> str:
        """acks_late: a cold shutdown leaves its message unacked, so it comes back (worker lost)."""
        return body(self, key, seconds, cleanup, note)

    @keyed_task(app=app, name="acceptance.cleanup_early_ack", bind=True, concurrency_key="{key}", acks_late=False)
    def cleanup_early_ack(self: Any, key: str, seconds: float, cleanup: float, note: str = "") -> str:
        """Acked when it starts: a cold shutdown that stops it ends it for good."""
        return body(self, key, seconds, cleanup, note)

    ns.cleanup, ns.cleanup_early_ack = cleanup, cleanup_early_ack
