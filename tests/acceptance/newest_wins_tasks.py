"""Tasks of the newest-wins tests (tests/acceptance/test_newest_wins_workers.py, issue 14 item 1): a long render of a
document that a newer call of the same document cancels. It writes its start and end into ``observed`` (the
independent observer); on prefork the gate terminates its pool process (SIGTERM), whose handler writes the end
(note ``terminated``) before the process exits; on the threads pool it polls ``keyed_cancelled()`` and stops."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from celery_keyed import KeyedSuperseded, keyed_task


def define(app: Any, ns: Any) -> None:
    from tests.acceptance.proj import observe

    @keyed_task(
        app=app, name="acceptance.render", bind=True, concurrency_key="{key}", supersede_key="{doc}",
        on_newer="cancel_running", acks_late=True,
    )
    def render(self: Any, key: str, doc: str, seconds: float, note: str = "") -> str:
        task_id = self.request.id

        def terminated(signum: int, frame: Any) -> None:
            observe(ns.dsn, "end", task_id, key, "terminated")
            os._exit(128 + signum)

        # A prefork pool process runs the task in its main thread (the only one that may set a signal handler).
        in_pool_process = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, terminated) if in_pool_process else signal.SIG_DFL
        observe(ns.dsn, "start", task_id, key, note)
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                if self.keyed_cancelled():  # the pools that cannot terminate a task (threads here)
                    observe(ns.dsn, "end", task_id, key, "cancelled")
                    raise KeyedSuperseded(f"{note} stopped: a newer render of {doc} arrived")
                time.sleep(0.02)
            observe(ns.dsn, "end", task_id, key, note)
            return note
        finally:
            if in_pool_process:
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

    ns.render = render
