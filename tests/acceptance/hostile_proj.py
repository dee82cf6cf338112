"""The acceptance app plus the tasks of the hostile-input test (tests/acceptance/test_hostile.py): keys that a
foreign producer's arguments can break (a callable that needs an argument, a format spec, a callable that
raises), a gate of 2 and a group. Every body writes its start and end into ``observed``."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from celery_keyed import keyed_task
from tests.acceptance.proj import make_app as make_base_app
from tests.acceptance.proj import observe


def _boom(x: Any = None, **_: Any) -> str:
    return f"boom:{1 / 0}"


class _Escape(BaseException):
    """Neither an ``Exception`` nor a signal: what a key callable may raise that the consumer loop does not catch."""


def _leaves(how: str, **_: Any) -> str:
    """A key callable that leaves the process's way of handling errors: ``sys.exit``, a ``KeyboardInterrupt`` raised
    by hand, a ``BaseException`` of its own; "ok" computes a key."""
    if how == "exit":
        raise SystemExit(3)
    if how == "interrupt":
        raise KeyboardInterrupt
    if how == "base":
        raise _Escape("not an Exception")
    return f"esc:{how}"


def make_app(env: Mapping[str, str]) -> Any:
    ns = make_base_app(env)
    app = ns.app

    def body(task: Any, key: str, seconds: float = 0.0) -> str:
        observe(ns.dsn, "start", task.request.id, key)
        time.sleep(seconds)
        observe(ns.dsn, "end", task.request.id, key)
        return key

    @keyed_task(app=app, name="hostile.tenant", bind=True, concurrency_key=lambda tenant_id, **_: ("tenant", tenant_id))
    def tenant(self: Any, tenant_id: Any, **_: Any) -> str:
        return body(self, f"tenant:{tenant_id}")

    @keyed_task(app=app, name="hostile.fmt", bind=True, concurrency_key="fmt:{n:05d}")
    def fmt(self: Any, n: Any) -> str:
        return body(self, f"fmt:{n}")

    @keyed_task(app=app, name="hostile.boom", bind=True, concurrency_key=_boom)
    def boom(self: Any, x: Any = None, **_: Any) -> str:
        return body(self, "boom")

    @keyed_task(app=app, name="hostile.echo", bind=True, concurrency_key="{key}")
    def echo(self: Any, key: Any, *rest: Any, **kwargs: Any) -> str:
        return body(self, str(key))

    @keyed_task(app=app, name="hostile.limited", bind=True, concurrency_key="lim:{which}")
    def limited(self: Any, which: Any, seconds: float = 0.2) -> str:
        return body(self, f"lim:{which}", min(float(seconds), 2.0))

    @keyed_task(app=app, name="hostile.grouped", bind=True, group_key="grp:{group}")
    def grouped(self: Any, group: Any, seq: Any = 0) -> str:
        return body(self, f"grp:{group}")

    @keyed_task(app=app, name="hostile.trusted", bind=True, concurrency_key="lim:{which}", per_call_keys=True)
    def trusted(self: Any, which: Any, seconds: float = 0.2) -> str:
        """Its producers may name its keys per call (a trusted producer's deliberate choice)."""
        return body(self, "trusted", min(float(seconds), 2.0))

    @keyed_task(app=app, name="hostile.escape", bind=True, concurrency_key=_leaves)
    def escape(self: Any, how: str) -> str:
        return body(self, f"esc:{how}")

    return ns


if "CELERY_BROKER_URL" in os.environ and "KEYED_DATABASE_URL" in os.environ:
    app = make_app(os.environ).app
