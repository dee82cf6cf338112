"""Ledger fixtures on real Postgres: a ``Ledger`` on the test's own database and a controllable clock."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import Ledger


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
    return Ledger(engine, holder="test-host:1:aaaa", lease=30.0, dispatch=10.0)


@pytest.fixture
def scalar(engine: sa.Engine) -> Callable[..., object]:
    """Run one SQL query and return its single value."""

    def run(sql: str, **params: object) -> object:
        with engine.connect() as conn:
            return conn.execute(sa.text(sql), params).scalar()

    return run
