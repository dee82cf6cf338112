"""The app of tests/contrib/test_plugin.py's subprocess workers: a mutex task that records its start and end in
the table ``observed`` of the ledger's database (on its own connection: an observer independent of the gate)."""

from __future__ import annotations

import os
import time

import psycopg
from celery import Celery

import celery_keyed
from celery_keyed import keyed_task

app = Celery("plugin_proj", set_as_current=False)
app.conf.worker_hijack_root_logger = False
celery_keyed.install(app)

OBSERVED = (
    "CREATE TABLE observed (id bigserial PRIMARY KEY, kind text NOT NULL, task_id text NOT NULL,"
    " key text NOT NULL, pid integer NOT NULL, at timestamptz NOT NULL)"
)


def dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def observe(kind: str, task_id: str, key: str) -> None:
    with psycopg.connect(dsn(app.conf.keyed_database_url), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO observed (kind, task_id, key, pid, at) VALUES (%s, %s, %s, %s, clock_timestamp())",
            (kind, task_id, key, os.getpid()),
        )


@keyed_task(app=app, bind=True, concurrency_key="account:{account_id}")
def sync(self: celery_keyed.KeyedTask, account_id: int, seconds: float = 0.3) -> int:
    key = f"account:{account_id}"
    observe("start", self.request.id, key)
    time.sleep(seconds)
    observe("end", self.request.id, key)
    return os.getpid()
