"""Time in ledger statements.

Every statement reads the time as ``COALESCE(:now, now())``: production passes ``now=None`` and uses the
database clock (one clock for every host, constant within a transaction); tests pass a ``datetime`` and move
time without sleeping.
"""

from __future__ import annotations

#: SQL expression for "now" in every ledger statement; bind ``now`` (a ``datetime`` or ``None``).
NOW = "COALESCE(CAST(:now AS timestamptz), now())"
