"""The Celery app the acceptance tests run in real worker processes.

Configured from the environment (KEYED_DATABASE_URL, CELERY_BROKER_URL, KEYED_LIMITS and KEYED_QUEUES as
JSON). Every task writes its start and end into ``observed`` (its own table, written on its own connection,
committed at once): the independent observer the tests check overlaps against.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import psycopg
from celery import Celery

import celery_keyed
from celery_keyed import keyed_task


def make_app(env: Mapping[str, str]) -> Any:
    """A Celery app and its tasks for one cluster (the workers build it from their environment, the test
    process from the cluster's)."""
    app = Celery("acceptance", set_as_current=False)
    app.conf.update(
        broker_url=env["CELERY_BROKER_URL"],
        result_backend=env.get("CELERY_RESULT_BACKEND", env["CELERY_BROKER_URL"]),
        result_extended=env.get("CELERY_RESULT_EXTENDED") == "1",
        keyed_database_url=env["KEYED_DATABASE_URL"],
        keyed_concurrency_limits=json.loads(env.get("KEYED_LIMITS", "{}")),
        keyed_lease=float(env.get("KEYED_LEASE", "10")),
        keyed_sweep_interval=0.2,
        keyed_self_fence=env.get("KEYED_SELF_FENCE", "1") == "1",
        keyed_statement_timeout=float(env.get("KEYED_STATEMENT_TIMEOUT", "2.0")),
        keyed_admission_batch=int(env.get("KEYED_ADMISSION_BATCH", "64")),
        keyed_park_at_receipt=env.get("KEYED_PARK_AT_RECEIPT", "1") == "1",
        keyed_claim_ahead=_claim_ahead(env.get("KEYED_CLAIM_AHEAD", "1")),
        keyed_config_version=int(env.get("KEYED_CONFIG_VERSION", "0")),
        keyed_send_arrival_timeout=float(env.get("KEYED_SEND_ARRIVAL_TIMEOUT", "3600")),
        keyed_connect_timeout=float(env.get("KEYED_CONNECT_TIMEOUT", "1.0")),
        keyed_queues=json.loads(env.get("KEYED_QUEUES", "[]")),
        worker_prefetch_multiplier=int(env.get("KEYED_PREFETCH", "1")),
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_cancel_long_running_tasks_on_connection_loss=env.get("CANCEL_ON_CONNECTION_LOSS") == "1",
        broker_transport_options={
            "visibility_timeout": float(env.get("VISIBILITY_TIMEOUT", "3600")),
            "unacked_restore_interval": 1,  # scan for messages of dead workers every second (kombu: 100 s)
            "unacked_restore_throttle": 1,
            # a worker killed holding the restore lock leaves it set until this expiry (kombu: 300 s); docs/guide.md
            "unacked_mutex_expire": 10,
        },
        worker_hijack_root_logger=False,
    )
    celery_keyed.install(app)
    if env.get("KEYED_LOG_SIGNALS") == "1":
        _log_signals()
    # OBSERVER_DSN: the observer's own database, when the ledger's may lose commits (a failover test)
    dsn = env.get("OBSERVER_DSN") or env["KEYED_DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://")
    ns = SimpleNamespace(app=app, dsn=dsn, url=env["KEYED_DATABASE_URL"])
    _define_tasks(app, ns)
    return ns


def _claim_ahead(value: str) -> bool | float:
    """KEYED_CLAIM_AHEAD: "1" (the default, True), "0" (off) or a number of seconds."""
    if value in ("0", "1"):
        return value == "1"
    return float(value)


def _log_signals() -> None:
    """Log every signal of the gate (tests/acceptance/test_events.py reads the worker's log)."""
    import logging

    from celery_keyed import signals

    log = logging.getLogger("celery_keyed.test_signals")
    for name in ("keyed_parked", "keyed_promoted", *(f"keyed_{o}" for o in signals.BY_OUTCOME)):

        def receiver(sender: Any, task_id: str, key: Any = None, _name: str = name, **kwargs: Any) -> None:
            log.warning("signal %s %s %s", _name, task_id, key)

        getattr(signals, name).connect(receiver, weak=False)


def wait_for_go(dsn: str, note: str, at_most: float) -> None:
    """Block until the test inserts an ``observed`` row of kind 'go' for ``note`` (``Cluster.let_go``)."""
    deadline = time.monotonic() + at_most
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            if conn.execute("SELECT 1 FROM observed WHERE kind = 'go' AND note = %s", (note,)).fetchone():
                return
            time.sleep(0.05)


def observe(dsn: str, kind: str, task_id: str, key: str, note: str = "", fence: int | None = None) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        # claimed_at: when the ledger gave the running attempt its slot (a rate token is taken then).
        conn.execute(
            "INSERT INTO observed (kind, task_id, key, note, pid, at, fence, claimed_at)"
            " VALUES (%s, %s, %s, %s, %s, clock_timestamp(), %s,"
            " (SELECT max(claimed_at) FROM keyed_claims WHERE task_id = %s AND %s = 'start'))",
            (kind, task_id, key, note, os.getpid(), fence, task_id, kind),
        )


#: acceptance.tenant_job's limits by plan (the call's ``plan`` argument chooses its key's limit).
PLAN_LIMITS = {"premium": 3, "basic": 1}


def _define_tasks(app: Any, ns: Any) -> None:
    @keyed_task(app=app, name="acceptance.hold", bind=True, concurrency_key="{key}", acks_late=True, per_call_keys=True)
    def hold(self, key: str, seconds: float, note: str = "") -> str:
        # The fence of its claim: fences grow with every claim, taken under the key's slot lock, so on one key
        # they give the order in which the ledger admitted the tasks (D10).
        observe(ns.dsn, "start", self.request.id, key, note, getattr(self.request, "keyed_fence", None))
        if seconds < 0:  # held until the test lets it go (a 'go' row for this note), at most -seconds
            wait_for_go(ns.dsn, note, -seconds)
        else:
            time.sleep(seconds)
        observe(ns.dsn, "end", self.request.id, key, note)
        return note

    @keyed_task(
        app=app,
        name="acceptance.tenant_job",
        bind=True,
        concurrency_key="{tenant}",
        concurrency_limit=lambda plan, **_: PLAN_LIMITS[plan],
        acks_late=True,
    )
    def tenant_job(self, tenant: str, plan: str, seconds: float, note: str = "") -> str:
        """A tenant's job whose key's limit comes from the call (its tenant's plan)."""
        observe(ns.dsn, "start", self.request.id, tenant, note or plan)
        time.sleep(seconds)
        observe(ns.dsn, "end", self.request.id, tenant, note or plan)
        return plan

    @keyed_task(app=app, name="acceptance.ordered", bind=True, group_key="{group}", max_retries=5, acks_late=True)
    def ordered(self, group: str, seq: int, fail_times: int = 0, seconds: float = 0.05) -> int:
        observe(ns.dsn, "start", self.request.id, group, str(seq))
        time.sleep(seconds)
        if self.request.retries < fail_times:
            observe(ns.dsn, "fail", self.request.id, group, str(seq))
            raise self.retry(countdown=0.3, max_retries=fail_times if fail_times < 5 else 5)
        observe(ns.dsn, "end", self.request.id, group, str(seq))
        return seq

    @keyed_task(app=app, name="acceptance.flaky", bind=True, concurrency_key="{key}", acks_late=True, max_retries=3)
    def flaky(self, key: str, seconds: float, backoff: float) -> str:
        observe(ns.dsn, "start", self.request.id, key, str(self.request.retries))
        time.sleep(seconds)
        if self.request.retries == 0:
            observe(ns.dsn, "end", self.request.id, key, "retry")
            raise self.retry(countdown=backoff)
        observe(ns.dsn, "end", self.request.id, key, "done")
        return "done"

    @app.task(name="acceptance.unkeyed", bind=True, shared=False)
    def unkeyed(self, note: str = "") -> str:
        observe(ns.dsn, "start", self.request.id, "", note)
        observe(ns.dsn, "end", self.request.id, "", note)
        return note

    @app.task(name="acceptance.sleepy", bind=True, shared=False)
    def sleepy(self, seconds: float, note: str = "") -> str:
        observe(ns.dsn, "start", self.request.id, "", note)
        time.sleep(seconds)
        observe(ns.dsn, "end", self.request.id, "", note)
        return note

    @keyed_task(app=app, name="acceptance.override_in_task", bind=True, concurrency_key="{key}")
    def override_in_task(self, key: str, name: str, limit: int, fail: bool) -> str:
        """Writes its own row and an override in one transaction of the caller's connection (§3.7)."""
        import sqlalchemy as sa

        engine = sa.create_engine(ns.url, poolclass=sa.pool.NullPool)
        with engine.begin() as conn:
            conn.execute(
                sa.text("INSERT INTO observed (kind, task_id, key, note, at) VALUES ('work', :id, :k, '', now())"),
                {"id": self.request.id, "k": key},
            )
            celery_keyed.set_limit(app, name, limit, reason="set by a task", connection=conn)
            if fail:
                raise RuntimeError("the task's own work failed")
        return "ok"

    @keyed_task(app=app, name="acceptance.parent", bind=True, concurrency_key="{key}")
    def parent(self, key: str) -> str:
        """Needs a child under its own key: launches it with a callback instead of waiting for it (waiting
        inside the slot would deadlock when K = 1: the child parks behind its parent)."""
        observe(ns.dsn, "start", self.request.id, key, "parent")
        (hold.si(key, 0.05, note="child") | after.si(key)).apply_async()
        observe(ns.dsn, "end", self.request.id, key, "parent")
        return "parent"

    @keyed_task(app=app, name="acceptance.after", bind=True, concurrency_key="{key}")
    def after(self, key: str) -> str:
        observe(ns.dsn, "start", self.request.id, key, "after")
        observe(ns.dsn, "end", self.request.id, key, "after")
        return "after"

    @keyed_task(app=app, name="acceptance.charge", concurrency_key=lambda tenant_id, **_: ("stripe", tenant_id))
    def charge(tenant_id: int, amount: int) -> int:
        return amount

    ns.charge = charge

    @app.task(name="acceptance.ping", shared=False)
    def ping(note: str = "") -> str:
        """Unkeyed and touching no database: flows while Postgres is down."""
        return note

    @keyed_task(
        app=app, name="acceptance.feed", bind=True, concurrency_key="{key}", dedupe_key="{dedupe}", admit_at_send=True
    )
    def feed(self, key: str, seconds: float, dedupe: str | None = None) -> str:
        """Admitted at send (issue 14 item 3): refused before publishing when the room is full or dedupe is live."""
        observe(ns.dsn, "start", self.request.id, key, dedupe or "")
        time.sleep(seconds)
        observe(ns.dsn, "end", self.request.id, key, dedupe or "")
        return dedupe or key

    ns.feed = feed

    @keyed_task(
        app=app, name="acceptance.debounced", bind=True, concurrency_key="{key}", debounce=1.0, debounce_max=10.0
    )
    def debounced(self, key: str, note: str) -> str:
        """Debounced per key (issue 14 item 2): a burst of calls runs once, with the last call's note."""
        observe(ns.dsn, "start", self.request.id, key, note)
        observe(ns.dsn, "end", self.request.id, key, note)
        return note

    ns.debounced = debounced
    ns.hold, ns.ordered, ns.flaky, ns.unkeyed, ns.ping = hold, ordered, flaky, unkeyed, ping
    ns.sleepy = sleepy
    ns.tenant_job = tenant_job
    ns.override_in_task, ns.parent, ns.after = override_in_task, parent, after

    from tests.acceptance import (
        canvas_tasks,
        composition_tasks,
        fault_tasks,
        group_policy_tasks,
        newest_wins_tasks,
        retry_tasks,
        shutdown_tasks,
        throttle_tasks,
    )

    canvas_tasks.define(app, ns)
    composition_tasks.define(app, ns)
    fault_tasks.define(app, ns)
    newest_wins_tasks.define(app, ns)
    shutdown_tasks.define(app, ns)
    throttle_tasks.define(app, ns)
    retry_tasks.define(app, ns)
    group_policy_tasks.define(app, ns)


if "CELERY_BROKER_URL" in os.environ and "KEYED_DATABASE_URL" in os.environ:
    app = make_app(os.environ).app

if os.environ.get("KEYED_TEST_DIE_AFTER_POP"):  # tests/acceptance/midpop.py: a worker killed mid-pop
    from tests.acceptance.midpop import die_after_pop

    die_after_pop(os.environ["KEYED_TEST_DIE_AFTER_POP"])
