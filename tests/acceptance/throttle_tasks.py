"""Tasks of the acceptance tests of a key that throttles itself (issue 14 item 4), defined on the acceptance app by
``proj``."""

from __future__ import annotations

import time
from typing import Any


def define(app: Any, ns: Any) -> None:
    from celery_keyed import keyed_task
    from tests.acceptance.proj import observe

    @keyed_task(app=app, name="acceptance.vendor_call", bind=True, concurrency_key="{key}")
    def vendor_call(
        self: Any, key: str, seconds: float, note: str = "", retry_after: float | None = None,
        limit: int | None = None, limit_for: float | None = None,
    ) -> str:
        """A call to a vendor: on a 429 (``retry_after``) it pauses its own key; a concurrency header (``limit``) sets
        its key's limit. Writes its start, the end of the pause it set (``paused``, note: ISO time) and its end."""
        observe(ns.dsn, "start", self.request.id, key, note, getattr(self.request, "keyed_fence", None))
        if retry_after is not None:
            until = self.keyed_pause(retry_after, reason=f"429 Retry-After {retry_after:g}")
            observe(ns.dsn, "paused", self.request.id, key, until.isoformat())
        if limit is not None:
            self.keyed_set_limit(limit, expires=limit_for, reason=f"X-Concurrency-Limit: {limit}")
        time.sleep(seconds)
        observe(ns.dsn, "end", self.request.id, key, note)
        return note

    ns.vendor_call = vendor_call
