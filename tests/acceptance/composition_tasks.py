"""Tasks of the composition acceptance tests (issue 4), defined on the acceptance app by ``proj``."""

from __future__ import annotations

import time
from typing import Any


def define(app: Any, ns: Any) -> None:
    from celery_keyed import keyed_task
    from tests.acceptance.proj import observe

    @keyed_task(app=app, name="acceptance.tenant_call", bind=True, concurrency_key=["tenant:{tenant}", "stripe"])
    def tenant_call(self: Any, tenant: str, seconds: float) -> str:
        """Per tenant K = 2 and a global gate: both keys at once or neither."""
        observe(ns.dsn, "start", self.request.id, f"tenant:{tenant}")
        time.sleep(seconds)
        observe(ns.dsn, "end", self.request.id, f"tenant:{tenant}")
        return tenant

    @keyed_task(app=app, name="acceptance.early", bind=True, concurrency_key="{key}")
    def early(self: Any, key: str, keyed_seconds: float, unkeyed_seconds: float) -> bool:
        """Holds its key for the first part only: release_concurrency() lets the next task of the key start."""
        observe(ns.dsn, "start", self.request.id, key, "keyed")
        time.sleep(keyed_seconds)
        observe(ns.dsn, "end", self.request.id, key, "keyed")  # before the slot goes: the next may start at once
        released = self.release_concurrency()
        observe(ns.dsn, "start", self.request.id, "unkeyed-part", "unkeyed")
        time.sleep(unkeyed_seconds)
        observe(ns.dsn, "end", self.request.id, "unkeyed-part", "unkeyed")
        return released

    @keyed_task(app=app, name="acceptance.rekey", bind=True, concurrency_key="{key}", max_retries=2, per_call_keys=True)
    def rekey(self: Any, key: str, new_key: str) -> str:
        """The first attempt retries under another key; the retry is admitted under it."""
        if self.request.retries == 0:
            raise self.retry(countdown=0.1, concurrency_key=new_key)
        observe(ns.dsn, "start", self.request.id, new_key, "retry")
        observe(ns.dsn, "end", self.request.id, new_key, "retry")
        return new_key

    @keyed_task(
        app=app,
        name="acceptance.stuck_call",
        bind=True,
        concurrency_key="{key}",
        time_limit=0.5,
        uncertain_hold=2.0,
        acks_late=False,
    )
    def stuck_call(self: Any, key: str) -> None:
        """A remote call that hangs past the hard time limit."""
        observe(ns.dsn, "start", self.request.id, key, "stuck")
        time.sleep(10)

    ns.tenant_call, ns.early, ns.rekey, ns.stuck_call = tenant_call, early, rekey, stuck_call
