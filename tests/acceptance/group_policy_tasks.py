"""A member of an ordered group that succeeds, fails for good, or asks for one retry (tests/acceptance/
test_group_policies_workers.py). Its body writes ``start`` and ``end`` (or ``fail``) into the observer table, with
the member's number and attempt as the note (``"<seq>/<attempt>"``)."""

from __future__ import annotations

import time
from typing import Any

from celery_keyed import keyed_task


class StepFailed(Exception):
    """The body's own failure."""


def define(app: Any, ns: Any) -> None:
    from tests.acceptance.proj import observe

    @keyed_task(app=app, name="acceptance.step", bind=True, group_key="{group}", acks_late=True, max_retries=3)
    def step(self: Any, group: str, seq: int, fail: str = "no", seconds: float = 0.05) -> int:
        """``fail``: "no" (succeeds), "final" (raises: a final failure), "retry" (its first attempt asks for a
        retry in 0.2 s, the retry succeeds)."""
        note = f"{seq}/{self.request.retries}"
        observe(ns.dsn, "start", self.request.id, group, note)
        time.sleep(seconds)
        if fail == "final":
            observe(ns.dsn, "fail", self.request.id, group, note)
            raise StepFailed(f"member {seq} of {group} failed")
        if fail == "retry" and self.request.retries == 0:
            observe(ns.dsn, "fail", self.request.id, group, note)
            raise self.retry(countdown=0.2)
        observe(ns.dsn, "end", self.request.id, group, note)
        return seq

    ns.step = step
