"""Removing celery-keyed from a project: ``celery keyed drop-ledger`` drops every object of the ledger from its
database and nothing else — only with ``--yes``, and never while tasks wait in the ledger or slots are held (their
messages live only there) unless ``--force``. Migrating again afterwards gives a working ledger."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_keyed.ledger import Arrival, Ledger, Outcome, Token, Verdict, migrate
from celery_keyed.publisher import close_publisher
from tests.integration.test_cli import run

LEDGER_OBJECTS = """
    SELECT 'relation ' || c.relname FROM pg_class c
     WHERE c.relnamespace = current_schema()::regnamespace AND c.relname LIKE 'keyed\\_%%'
    UNION ALL
    SELECT 'routine ' || p.proname FROM pg_proc p
     WHERE p.pronamespace = current_schema()::regnamespace AND p.proname LIKE 'keyed\\_%%'
    UNION ALL
    SELECT 'type ' || t.typname FROM pg_type t
     WHERE t.typnamespace = current_schema()::regnamespace AND t.typname LIKE 'keyed\\_%%'
"""


@pytest.fixture
def app(database_url: str, redis_url: str) -> Iterator[Celery]:
    app = Celery("drop-test", broker=redis_url, set_as_current=False)
    app.conf.keyed_database_url = database_url
    yield app
    close_publisher(app)
    app.close()


def leftovers(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return sorted(conn.exec_driver_sql(LEDGER_OBJECTS).scalars())


def test_drop_ledger_asks_refuses_while_work_waits_then_drops_every_object_and_nothing_else(
    app: Celery, engine: sa.Engine
) -> None:
    with engine.begin() as conn:  # a table of the project's own, beside the ledger's: never touched
        conn.exec_driver_sql("CREATE TABLE shop_orders (id integer PRIMARY KEY)")
        conn.exec_driver_sql("CREATE TABLE keyedish (id integer)")
    before = leftovers(engine)
    assert "relation keyed_tasks" in before and "routine keyed_release_many" in before

    ledger = Ledger(engine, holder="worker-1:1:beef", lease=60.0)
    running = ledger.admit(Arrival("t-run", key="acct:1"))
    assert ledger.admit(Arrival("t-wait", key="acct:1")).verdict is Verdict.PARKED

    assert "run it again with --yes" in run(app, "drop-ledger", code=1).output  # nothing without --yes
    refused = run(app, "drop-ledger", "--yes", code=1).output
    assert "1 task(s) waiting" in refused and "1 slot(s) held" in refused
    assert leftovers(engine) == before

    # The waiting task runs once the running one releases its slot; then nothing is held or waits.
    report = ledger.release(Token("t-run", 0), running.fence, Outcome.COMPLETED)
    (promoted,) = report.promotions
    fence = ledger.bind(Token("t-wait", 0), promoted.nonce)
    assert fence is not None
    ledger.release(Token("t-wait", 0), fence, Outcome.COMPLETED)

    dropped = json.loads(run(app, "drop-ledger", "--yes", "--json").stdout)["dropped"]
    assert "table keyed_tasks" in dropped and "table keyed_migrations" in dropped
    assert leftovers(engine) == []  # every object of the ledger is gone...
    with engine.connect() as conn:  # ...and nothing else
        assert conn.exec_driver_sql("SELECT to_regclass('shop_orders'), to_regclass('keyedish')").one() == (
            "shop_orders", "keyedish")
    assert "no objects to drop" in run(app, "drop-ledger", "--yes").output  # again: nothing left, no error

    migrate(engine)  # installed again: a working ledger
    assert leftovers(engine) == before
    again = Ledger(engine, holder="worker-1:1:beef", lease=60.0)
    assert again.admit(Arrival("t-new", key="acct:1")).verdict is Verdict.ADMITTED


def test_drop_ledger_force_drops_a_ledger_with_waiting_tasks(app: Celery, engine: sa.Engine) -> None:
    ledger = Ledger(engine, holder="worker-1:1:beef", lease=60.0)
    ledger.admit(Arrival("t-run", key="acct:1"))
    ledger.admit(Arrival("t-wait", key="acct:1"))
    run(app, "drop-ledger", "--yes", "--force")
    assert leftovers(engine) == []
