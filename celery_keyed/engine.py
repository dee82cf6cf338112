"""The ledger's SQLAlchemy engine for a Celery process: bounded connect and statement times, so a ledger call
from the consumer loop can never block it for long (DESIGN §5)."""

from __future__ import annotations

import math

import sqlalchemy as sa

from celery_keyed.settings import KeyedSettings


def create_ledger_engine(settings: KeyedSettings) -> sa.Engine:
    return sa.create_engine(
        settings.database_url,
        pool_size=settings.pool_size,
        max_overflow=settings.pool_size,
        pool_timeout=settings.connect_timeout,
        connect_args={
            "connect_timeout": max(1, math.ceil(settings.connect_timeout)),
            "options": f"-c statement_timeout={int(settings.statement_timeout * 1000)}",
            "application_name": "celery-keyed",
        },
    )
