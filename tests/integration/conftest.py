"""Ledger fixtures on real Postgres: a ``Ledger`` on the test's own database and a controllable clock."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import Ledger
from celery_keyed.ledger.caps import Caps


class Clock:
    """Explicit time for ledger calls. Starts an hour ahead of real time so that the reaper's guard
    (the server must have been up for a full lease, D7) holds for short test leases."""

    def __init__(self) -> None:
        self.now = datetime.now(UTC) + timedelta(hours=1)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> datetime:
        self.now += timedelta(seconds=seconds)
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def ledger(engine: sa.Engine) -> Ledger:
    ledger = Ledger(engine, holder="test-host:1:aaaa", lease=30.0, dispatch=10.0)
    # Which names have a cap: read at the first arrival and when this ledger configures names, not again every few
    # seconds as in a worker, so that a test counting an arrival's statements counts only the arrival's own.
    ledger.caps = Caps(engine, ttl=float("inf"))
    return ledger


@pytest.fixture
def gauge(database_url: str) -> Iterator[Callable[..., float | None]]:
    """One sample of the ledger gauges, read as a scrape reads them (a ``LedgerCollector`` on the test's database):
    ``gauge("celery_keyed_in_flight", name="api")``."""
    from prometheus_client import CollectorRegistry

    from celery_keyed.metrics import LedgerCollector

    collector = LedgerCollector(database_url, timeout=1.0)
    registry = CollectorRegistry()
    registry.register(collector)
    try:
        yield lambda metric, **labels: registry.get_sample_value(metric, labels)
    finally:
        collector.engine.dispose()


@pytest.fixture
def scalar(engine: sa.Engine) -> Callable[..., object]:
    """Run one SQL query and return its single value."""

    def run(sql: str, **params: object) -> object:
        with engine.connect() as conn:
            return conn.execute(sa.text(sql), params).scalar()

    return run


#: A later release's migration, as the package would ship it: it adds what the test takes out of the initial schema
#: (a column the worker's first calls write, one reconcile reads), so that a ledger left at the initial schema is
#: behind this "version" exactly as a ledger of an older release is behind a newer one.
LATER_MIGRATION = (
    "0002_later_release",
    "ALTER TABLE keyed_holders ADD COLUMN machine text;\n"
    "CREATE INDEX keyed_holders_machine_idx ON keyed_holders (machine) WHERE machine IS NOT NULL;\n"
    "ALTER TABLE keyed_waiting ADD COLUMN reserved_at timestamptz;\n"
    "ALTER TABLE keyed_waiting ADD CONSTRAINT keyed_waiting_reserved_when\n"
    "    CHECK ((reserved_keys IS NULL) = (reserved_at IS NULL));\n"
    "CREATE INDEX keyed_waiting_reserved_idx ON keyed_waiting (reserved_at) WHERE reserved_at IS NOT NULL;\n",
)


@pytest.fixture
def ledger_of_an_older_release(monkeypatch: pytest.MonkeyPatch) -> Callable[[sa.Engine], list[str]]:
    """Leave a blank database as an older release left it: the initial migration applied and recorded, without what
    ``LATER_MIGRATION`` adds, which the package (patched for the test) ships as pending. Returns the pending
    versions."""
    from celery_keyed.ledger import migrations

    shipped = migrations.migration_files()
    monkeypatch.setattr(migrations, "migration_files", lambda: [*shipped, LATER_MIGRATION])

    def leave(engine: sa.Engine) -> list[str]:
        (first, sql), *_ = shipped
        with engine.connect() as conn:
            conn.execute(sa.text("CREATE TABLE keyed_migrations (version text PRIMARY KEY, applied_at timestamptz)"))
            migrations._execute_script(conn, sql)
            conn.execute(sa.text("ALTER TABLE keyed_holders DROP COLUMN machine"))
            conn.execute(sa.text("ALTER TABLE keyed_waiting DROP COLUMN reserved_at"))
            conn.execute(sa.text("INSERT INTO keyed_migrations VALUES (:v, now())"), {"v": first})
            conn.commit()
        return [version for version, _ in [*shipped, LATER_MIGRATION][1:]]

    return leave
