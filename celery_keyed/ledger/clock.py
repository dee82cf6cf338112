"""Time in ledger statements.

Every statement reads the time as ``COALESCE(:now, now())``: production passes ``now=None`` and uses the
database clock (one clock for every host, constant within a transaction); tests pass a ``datetime`` and move
time without sleeping.
"""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa

#: SQL expression for "now" in every ledger statement; bind ``now`` (a ``datetime`` or ``None``).
NOW = "COALESCE(CAST(:now AS timestamptz), now())"

# clock_is_future / clock_is_past: compare a time with the ledger's "now" in the database's clock (the one clock
# of every host, D2); no lock, no write.
CLOCK_IS_FUTURE = sa.text(f"SELECT CAST(:when AS timestamptz) > {NOW}")
CLOCK_IS_PAST = sa.text(f"SELECT CAST(:when AS timestamptz) <= {NOW}")


def clock_is_future(conn: sa.Connection, when: datetime | None, now: datetime | None) -> bool:
    return bool(conn.execute(CLOCK_IS_FUTURE, {"when": when, "now": now}).scalar_one())


def clock_is_past(conn: sa.Connection, when: datetime | None, now: datetime | None) -> bool:
    """Whether ``when`` has passed; never for None (no deadline)."""
    if when is None:
        return False
    return bool(conn.execute(CLOCK_IS_PAST, {"when": when, "now": now}).scalar_one())
