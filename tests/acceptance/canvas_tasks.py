"""Tasks of the canvas tests (tests/acceptance/test_canvas.py): keyed members of chains, groups and chords, an unkeyed
tail and chord body, and an errback. Each writes into ``observed`` (the independent observer): its start (and end),
the body its arguments, the errback the id of the task whose failure it was called for."""

from __future__ import annotations

import json
import time
from typing import Any

from celery_keyed import keyed_task


def define(app: Any, ns: Any) -> None:
    from tests.acceptance.proj import observe

    @keyed_task(app=app, name="canvas.step", bind=True, concurrency_key="{key}", acks_late=True)
    def step(self: Any, key: str, note: str, seconds: float = 0.0) -> str:
        observe(ns.dsn, "start", self.request.id, key, note)
        time.sleep(seconds)
        observe(ns.dsn, "end", self.request.id, key, note)
        return note

    @keyed_task(app=app, name="canvas.doc", bind=True, concurrency_key="{key}", supersede_key="{doc}", acks_late=True)
    def doc(self: Any, key: str, doc: str, note: str) -> str:
        """Supersede mode (its name's overflow policy ``supersede``): a newer call of the same doc replaces it."""
        observe(ns.dsn, "start", self.request.id, key, note)
        return note

    @keyed_task(app=app, name="canvas.debounced", bind=True, concurrency_key="{key}", debounce=1.5, debounce_max=10.0)
    def debounced(self: Any, key: str, note: str) -> str:
        observe(ns.dsn, "start", self.request.id, key, note)
        return note

    @keyed_task(app=app, name="canvas.feed", bind=True, concurrency_key="{key}", admit_at_send=True)
    def feed(self: Any, key: str, note: str) -> str:
        """Admitted at send: refused in the sender's process when its key's waiting room is full."""
        observe(ns.dsn, "start", self.request.id, key, note)
        return note

    @app.task(name="canvas.tail", bind=True, shared=False)
    def tail(self: Any, case: str, note: str) -> str:
        observe(ns.dsn, "start", self.request.id, case, note)
        return note

    @app.task(name="canvas.body", bind=True, shared=False)
    def body(self: Any, results: list[Any], case: str) -> list[Any]:
        observe(ns.dsn, "start", self.request.id, case, json.dumps(results))
        return results

    @app.task(name="canvas.errback", bind=True, shared=False)
    def errback(self: Any, task_id: str, case: str) -> None:
        """An errback (``link_error``): called with the id of the task that failed."""
        observe(ns.dsn, "errback", task_id, case)

    ns.cv_step, ns.cv_doc, ns.cv_debounced, ns.cv_feed = step, doc, debounced, feed
    ns.cv_tail, ns.cv_body, ns.cv_errback = tail, body, errback
