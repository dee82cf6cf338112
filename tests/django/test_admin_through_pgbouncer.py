"""The admin's ledger connections through a transaction-mode PgBouncer (Debian's, its defaults): the operator's
changes and reads work from several threads at once, and each transaction keeps its statement timeout.

(Found on a release without this: the admin's engine connected by a creator of its own, so none of the workers'
session rules applied — psycopg prepared a statement on its fifth run, the next run reached another server
connection and failed with ``prepared statement "_pg3_0" does not exist``, and no statement timeout was set.)"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from celery_keyed.access import ledger_on
from celery_keyed.testing import PgBouncerServer

THREADS = 6
ROUNDS = 20  # psycopg prepares a statement server-side on its fifth run on a connection (prepare_threshold = 5)


@pytest.fixture
def engine_through_pooler(db: None, pgbouncers: Callable[..., PgBouncerServer]) -> Iterator[sa.Engine]:
    from celery_keyed_django.ledger import engine_for
    from django.db import connections

    bouncer = pgbouncers("transaction")
    default = connections["default"]
    through = type(default)(
        {**default.settings_dict, "HOST": "127.0.0.1", "PORT": str(bouncer.port)}, alias="through_pgbouncer"
    )
    engine = engine_for(through)
    yield engine
    engine.dispose()


def test_operators_changes_and_reads_through_a_transaction_pooler(engine_through_pooler: sa.Engine) -> None:
    from celery_keyed_django.ledger import Timing

    ledger = ledger_on(engine_through_pooler, Timing(lease=60.0, dispatch_timeout=30.0), holder="django-admin:0:0")
    failures: list[BaseException] = []

    def operator(n: int) -> None:
        try:
            for i in range(ROUNDS):
                ledger.set_override(f"pooled{n}", 1 + i % 3, reason="through PgBouncer", author="test")
                ledger.explain(f"no-such-task-{n}-{i}")
                ledger.clear_override(f"pooled{n}", reason="through PgBouncer", author="test")
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=operator, args=(n,), name=f"operator-{n}") for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    with engine_through_pooler.connect() as conn:
        changes: Any = conn.execute(
            sa.text("SELECT count(*) FROM keyed_override_log WHERE reason = 'through PgBouncer'")
        ).scalar()
        assert changes == THREADS * ROUNDS * 2


def test_each_transaction_through_the_pooler_has_the_statement_timeout(engine_through_pooler: sa.Engine) -> None:
    for _ in range(3):
        with engine_through_pooler.begin() as conn:
            assert conn.exec_driver_sql("SHOW statement_timeout").scalar() == "5s"


def test_a_statement_run_often_survives_moving_to_another_server_connection(
    engine_through_pooler: sa.Engine,
) -> None:
    """A transaction pooler gives each transaction whichever server connection is free: a statement that psycopg
    prepared on one (on its fifth run) must not be expected on the next."""
    statement = sa.text("SELECT count(*) FROM keyed_names WHERE name = :name")
    with engine_through_pooler.connect() as mine, engine_through_pooler.connect() as other:
        for i in range(ROUNDS):
            with mine.begin():
                mine.execute(statement, {"name": f"n{i}"})
            # another client takes the server connection mine just gave back (PgBouncer reuses the last one freed)...
            with other.begin():
                other.execute(sa.text("SELECT 1"))
                # ...so mine's next transaction runs on another one
                with mine.begin():
                    assert mine.execute(statement, {"name": "none"}).scalar() == 0
