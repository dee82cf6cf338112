"""Tasks of the fault tests (tests/acceptance/test_faults.py): keys that fail on hostile arguments, and a keyed
task that touches no database (it finishes while Postgres is down)."""

from __future__ import annotations

import time
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

    ns.fmt, ns.divide, ns.nap = fmt, divide, nap
