"""The Celery app of the demo (``python -m example_project.demo``), configured from the environment.

- ``CELERY_BROKER_URL``: the Redis broker (also the result backend unless ``CELERY_RESULT_BACKEND`` is set);
- ``KEYED_DATABASE_URL``: the slot ledger (a ``postgresql+psycopg://`` URL);
- ``DEMO_UNIT``: seconds in one time unit of the demo (default 0.5); the ``research`` limits are in units;
- ``KEYED_LIMITS``: JSON that replaces the limits below;
- ``DEMO_QUEUE``: the queue the tasks go to (the demo picks a fresh one per run).

Three patterns, three tasks:

- ``research`` is a gate of 2 with a bounded waiting room (3 places, 6 units at most): a ninth caller is
  told ``KeyedRejected`` at once, a waiter that cannot start in time is told ``KeyedExpired``;
- ``account`` is not configured, so every ``account:{id}`` key is a mutex: one sync per account at a time,
  accounts in parallel;
- ``api`` is a gate of 3 shared by every tenant: never more than 3 calls in flight to the partner API.

Every task writes its start and end into ``demo_observed`` (on its own connection, committed at once): an
observer independent of the ledger, which the demo reads to draw its timeline and check the bounds.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

import psycopg
from celery import Celery

import celery_keyed
from celery_keyed import keyed_task

DEFAULT_UNIT = 0.5
DEFAULT_BROKER = "redis://127.0.0.1:6379/0"

OBSERVED_DDL = """
CREATE TABLE IF NOT EXISTS demo_observed (
    id bigserial PRIMARY KEY,
    kind text NOT NULL,
    task_id text NOT NULL,
    key text NOT NULL,
    label text NOT NULL,
    worker text NOT NULL,
    pid integer NOT NULL,
    at timestamptz NOT NULL
)
"""


def unit_seconds(env: Mapping[str, str] = os.environ) -> float:
    return float(env.get("DEMO_UNIT") or DEFAULT_UNIT)


def demo_limits(unit: float) -> dict[str, Any]:
    """The limits by name; ``account`` is deliberately absent (unconfigured name = mutex per key)."""
    return {
        "research": {"limit": 2, "max_waiting": 3, "max_wait": 6 * unit},
        "api": {"limit": 3},
    }


def libpq_dsn(url: str) -> str:
    """``postgresql+psycopg://…`` → ``postgresql://…`` for ``psycopg.connect``."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def make_app(env: Mapping[str, str] = os.environ) -> Celery:
    broker = env.get("CELERY_BROKER_URL") or DEFAULT_BROKER
    limits = json.loads(env["KEYED_LIMITS"]) if env.get("KEYED_LIMITS") else demo_limits(unit_seconds(env))
    app = Celery("example_project.demo_app", set_as_current=False)
    app.conf.update(
        broker_url=broker,
        result_backend=env.get("CELERY_RESULT_BACKEND") or broker,
        result_expires=3600,
        keyed_database_url=env.get("KEYED_DATABASE_URL") or None,
        keyed_concurrency_limits=limits,
        keyed_lease=10.0,
        keyed_sweep_interval=0.2,
        keyed_statement_timeout=2.0,
        keyed_connect_timeout=1.0,
        task_default_queue=env.get("DEMO_QUEUE") or "keyed-demo",
        # Keyed tasks are admitted when a pool process is ready for them: prefetch one message per process,
        # acknowledge after the task, and redeliver the message of a worker that died.
        worker_prefetch_multiplier=1,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )
    celery_keyed.install(app)
    return app


app = make_app()


def observe(kind: str, task: Any, key: str, label: str) -> None:
    """Write one start or end into the observer table, committed at once (not through the ledger)."""
    with psycopg.connect(libpq_dsn(str(app.conf.keyed_database_url)), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO demo_observed (kind, task_id, key, label, worker, pid, at)"
            " VALUES (%s, %s, %s, %s, %s, %s, clock_timestamp())",
            (kind, task.request.id, key, label, str(task.request.hostname or ""), os.getpid()),
        )


def _work(task: Any, key: str, label: str, seconds: float) -> str:
    observe("start", task, key, label)
    time.sleep(seconds)
    observe("end", task, key, label)
    return label


@keyed_task(app=app, name="demo.research", bind=True, concurrency_key="research:{topic}")
def research(self: Any, topic: str, label: str, seconds: float) -> str:
    """A slow research job: at most 2 per topic, 3 may wait, none waits longer than 6 units."""
    return _work(self, f"research:{topic}", label, seconds)


@keyed_task(app=app, name="demo.sync_account", bind=True, concurrency_key="account:{account_id}")
def sync_account(self: Any, account_id: int, label: str, seconds: float) -> str:
    """Sync one account: one at a time per account, accounts in parallel."""
    return _work(self, f"account:{account_id}", label, seconds)


@keyed_task(app=app, name="demo.call_api", bind=True, concurrency_key="api:partner")
def call_api(self: Any, tenant: str, label: str, seconds: float) -> str:
    """A call to a partner API on behalf of a tenant: at most 3 in flight, whoever the tenant."""
    return _work(self, "api:partner", label, seconds)
