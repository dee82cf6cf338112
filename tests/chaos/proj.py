"""The Celery app the chaos harness runs in real prefork workers (``celery -A tests.chaos.proj worker``).

Configured from the environment: ``CELERY_BROKER_URL``, ``CELERY_RESULT_BACKEND``, ``KEYED_DATABASE_URL``,
``KEYED_LIMITS`` (JSON), ``KEYED_LEASE``, ``VISIBILITY_TIMEOUT`` and ``CHAOS_OBSERVED`` (a directory).

The observer is independent of the ledger and of both servers the harness breaks: each task body appends
``start`` and ``end`` lines to a file of its own process (``<dir>/<pid>.log``, one ``write`` per line, flushed
at once) and, while it runs, overwrites ``<dir>/<pid>.hb`` with the task id and the time every
``HEARTBEAT_STEP`` seconds: the last moment the body is known to have been running when it leaves no ``end``
(killed). A body given a ``cleanup`` handles SIGTERM: it goes on heartbeating for that long, then writes
``end … cleanup`` and its process exits. Times are ``CLOCK_MONOTONIC`` (one clock for every process on the machine,
the harness's included).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from celery import Celery

import celery_keyed
from celery_keyed import keyed_task

HEARTBEAT_STEP = 0.005


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


class Observer:
    """Per-process files of the observer (opened lazily in the pool process, reopened after a fork)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._pid = 0
        self._log = -1
        self._hb = -1

    def _open(self) -> None:
        pid = os.getpid()
        if self._pid != pid:
            base = os.path.join(self.directory, str(pid))
            self._log = os.open(base + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._hb = os.open(base + ".hb", os.O_WRONLY | os.O_CREAT, 0o644)
            self._pid = pid

    def line(self, *fields: object) -> None:
        self._open()
        os.write(self._log, (" ".join(str(f) for f in fields) + "\n").encode())

    def heartbeat(self, task_id: str) -> None:
        self._open()
        os.pwrite(self._hb, f"{task_id} {now():.6f}\n".ljust(80).encode(), 0)


def make_app(env: Mapping[str, str]) -> Any:
    app = Celery("chaos", set_as_current=False)
    broker = env["CELERY_BROKER_URL"]
    app.conf.update(
        broker_url=broker,
        result_backend=env.get("CELERY_RESULT_BACKEND", broker),
        keyed_database_url=env["KEYED_DATABASE_URL"],
        keyed_concurrency_limits=json.loads(env.get("KEYED_LIMITS", "{}")),
        keyed_lease=float(env.get("KEYED_LEASE", "4")),
        keyed_sweep_interval=0.2,
        keyed_statement_timeout=2.0,
        keyed_connect_timeout=1.0,
        keyed_probe_interval=0.5,
        keyed_reconcile_schedule=3.0,
        worker_prefetch_multiplier=1,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # a Redis outage must not end the worker
        broker_transport_options={
            "visibility_timeout": float(env.get("VISIBILITY_TIMEOUT", "3600")),
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            # a worker killed holding the restore lock leaves it set until this expiry (kombu: 300 s); docs/guide.md
            "unacked_mutex_expire": 10,
        },
        # Celery reads a task's stored meta before writing its result without retrying a connection error: with
        # the backend's Redis down, a body that ran to its end is marked failed. A careful user of a Redis
        # backend that may go away retries (ours is the broker's server, which the harness stops).
        result_backend_always_retry=True,
        result_backend_max_retries=120,
        result_backend_max_sleep_between_retries_ms=1000,
        worker_hijack_root_logger=False,
    )
    celery_keyed.install(app)
    ns = SimpleNamespace(app=app)
    observer = Observer(env.get("CHAOS_OBSERVED", "/tmp"))

    def body(request: Any, key: str, seconds: float, seq: int, cleanup: float) -> int:
        """``cleanup`` > 0: the body handles SIGTERM (a cold shutdown's cancel, a hard time limit) by cleaning up for
        that long, heartbeating, then writes ``end … cleanup`` and its process exits; SIGKILL may cut it short."""
        task_id = request.id
        previous = _handle_sigterm(observer, task_id, key, cleanup) if cleanup > 0 else None
        try:
            observer.line("start", task_id, key, f"{now():.6f}", request.hostname, os.getpgrp())
            deadline = now() + seconds
            while True:
                observer.heartbeat(task_id)
                left = deadline - now()
                if left <= 0:
                    break
                time.sleep(min(HEARTBEAT_STEP, left))
            observer.line("end", task_id, key, f"{now():.6f}")
            return seq
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    @keyed_task(app=app, name="chaos.work", bind=True, concurrency_key="{key}", acks_late=True)
    def work(self: Any, key: str, seconds: float, seq: int, cleanup: float = 0.0) -> int:
        return body(self.request, key, seconds, seq, cleanup)

    # Readers and writers of one key (a name configured with K > 1): readers share it, up to K at once; a writer
    # runs alone on it (README "Readers and writers").
    @keyed_task(app=app, name="chaos.read", bind=True, concurrency_key="{key}", acks_late=True)
    def read(self: Any, key: str, seconds: float, seq: int, cleanup: float = 0.0) -> int:
        return body(self.request, key, seconds, seq, cleanup)

    @keyed_task(
        app=app, name="chaos.write", bind=True, concurrency_key="{key}", concurrency_mode="exclusive", acks_late=True
    )
    def write(self: Any, key: str, seconds: float, seq: int, cleanup: float = 0.0) -> int:
        return body(self.request, key, seconds, seq, cleanup)

    ns.work, ns.read, ns.write = work, read, write
    return ns


def _handle_sigterm(observer: Observer, task_id: str, key: str, cleanup: float) -> Any:
    """Install the body's SIGTERM handler (a prefork pool process runs the body in its main thread); the previous
    handler, to put back when the body ends. A second SIGTERM during the cleanup changes nothing."""
    cleaning: list[bool] = []

    def cleaned_up(signum: int, frame: Any) -> None:
        if cleaning:
            return
        cleaning.append(True)
        deadline = now() + cleanup
        while now() < deadline:
            observer.heartbeat(task_id)
            time.sleep(HEARTBEAT_STEP)
        observer.line("end", task_id, key, f"{now():.6f}", "cleanup")
        os._exit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.signal(signal.SIGTERM, cleaned_up)
    return previous if previous is not None else signal.SIG_DFL


if "CELERY_BROKER_URL" in os.environ and "KEYED_DATABASE_URL" in os.environ:
    app = make_app(os.environ).app
