"""A task whose retry the broker loses (tests/acceptance/test_outbox_workers.py): its first attempt publishes its
retry, then takes that message off the Redis list before any worker sees it — as kombu's Redis transport loses a
message a worker pops just before it is killed — and notes whether it did (``dropped`` / ``missed``)."""

from __future__ import annotations

import json
from typing import Any

import redis

from celery_keyed import keyed_task


def define(app: Any, ns: Any) -> None:
    from tests.acceptance.proj import observe

    @keyed_task(app=app, name="acceptance.retry_lost", bind=True, concurrency_key="{key}", acks_late=True,
                max_retries=3)
    def retry_lost(self: Any, key: str) -> str:
        observe(ns.dsn, "start", self.request.id, key, str(self.request.retries))
        if self.request.retries == 0:
            retry = self.retry(countdown=0.2, throw=False)  # published (and registered) here
            observe(ns.dsn, "dropped" if _drop_retry(app, self.request.id) else "missed", self.request.id, key)
            raise retry
        observe(ns.dsn, "end", self.request.id, key, "done")
        return "done"

    ns.retry_lost = retry_lost


def _drop_retry(app: Any, task_id: str) -> bool:
    """Take the retry of ``task_id`` off the ``celery`` list; True when it was there. The worker runs this body with
    its one process and prefetch 1 and holds the running message unacked (acks_late), so its consumer pops nothing
    more until the body ends."""
    client = redis.Redis.from_url(app.conf.broker_url)
    try:
        for raw in client.lrange("celery", 0, -1):
            headers = json.loads(raw).get("headers") or {}
            if headers.get("id") == task_id and headers.get("retries") == 1:
                return bool(client.lrem("celery", 1, raw))
        return False
    finally:
        client.close()
