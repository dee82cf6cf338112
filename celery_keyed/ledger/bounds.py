"""What the ledger's columns and clocks can hold: the one place every range check of a number comes from.

Settings, ``set_override``, the CLI and the Django admin all check a number against these bounds before it reaches
Postgres, so a value out of range is a clear error naming the option and its range, never a database error or a
timestamp overflow in a running worker.
"""

from __future__ import annotations

import math
from typing import Any

from celery_keyed.ledger.errors import InvalidConfig

#: The largest value of an ``integer`` column (``slot_limit``, ``max_waiting``, ``attempt``, ``cost``, ...).
INT_MAX = 2**31 - 1
#: The largest value of a ``bigint`` column (``group_seq``, ``fence``, ``arrival``).
BIGINT_MAX = 2**63 - 1
#: The cost an exclusive attempt (``concurrency_mode="exclusive"``) holds of its key: more than any shared holder's
#: guard ``used + cost <= share`` can ever pass, so nothing else of the key starts while it runs whatever the limit
#: does meanwhile (raised or lowered); it is taken only when the key's ``used`` is 0. Its release gives back exactly
#: this (the claim row's cost). Below ``INT_MAX / 2`` so ``used + cost`` of a shared arrival never overflows; a limit
#: above it would let shared attempts join an exclusive one (docs/ledger.md, Readers and writers).
EXCLUSIVE_COST = 2**30
#: The largest slot limit (configured, override or a key's own): below ``EXCLUSIVE_COST``, so that no share of a limit
#: ever admits a shared attempt beside an exclusive one.
SLOT_LIMIT_MAX = EXCLUSIVE_COST - 1
#: The largest cost a shared attempt may ask for (``concurrency_cost``, the ``keyed_cost`` header): below the exclusive
#: cost, so no cost a producer picks makes a task exclusive, and ``used + cost`` never overflows an ``integer``.
COST_MAX = EXCLUSIVE_COST - 1
#: The most counter rows per key of a sharded gate (CHECK keyed_names_shards_range).
SHARDS_MAX = 1024
#: The largest waiting room per key (``max_waiting``): an ``integer`` column.
MAX_WAITING_MAX = INT_MAX
#: The longest duration in seconds (100 years): ``now + duration`` must stay a timestamp both Postgres and
#: Python's ``datetime`` (year 9999) can hold, and a timer of that length must be one ``threading`` can wait.
SECONDS_MAX = 36525 * 86400  # 100 years of 365.25 days: 3,155,760,000 s
#: The most a Postgres statement timeout can be (``statement_timeout`` is an int of milliseconds), in seconds.
STATEMENT_TIMEOUT_MAX = INT_MAX / 1000
#: Rates (starts per second per key): the slowest keeps the wait for one token within ``SECONDS_MAX`` for a cost
#: of up to 3,000 slots; the fastest keeps ``rate * elapsed`` a finite double precision value.
RATE_MIN = 1e-6
RATE_MAX = 1e9
#: The most tokens a rate-limited key can save up (``burst``): taken as an ``integer`` share of slots.
BURST_MAX = INT_MAX
#: Rate windows: the most a name can have, and the most starts one window allows (a key keeps one row per start of
#: its largest window's N, so this bounds a key's rows).
WINDOWS_MAX = 8
WINDOW_STARTS_MAX = 1_000_000


def check_int(value: Any, option: str, *, minimum: int = 0, maximum: int = INT_MAX) -> int:
    """``value`` as an int in ``[minimum, maximum]``; else :class:`InvalidConfig` naming ``option`` and the range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidConfig(f"{option} must be an integer, at least {minimum} and at most {maximum}, got {value!r}")
    if not minimum <= value <= maximum:
        raise InvalidConfig(f"{option} must be at least {minimum} and at most {maximum}, got {value}")
    return value


def check_seconds(value: Any, option: str, *, maximum: float = SECONDS_MAX) -> float:
    """``value`` as a finite positive number of seconds, at most ``maximum``; else :class:`InvalidConfig`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= maximum
    ):
        raise InvalidConfig(f"{option} must be a positive number of seconds, at most {_fmt(maximum)}, got {value!r}")
    return float(value)


def check_number(value: Any, option: str, *, minimum: float, maximum: float, unit: str) -> float:
    """``value`` as a finite number in ``[minimum, maximum]``; ``unit`` says what it counts, for the message."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not minimum <= value <= maximum
    ):
        bounds = f"at least {_fmt(minimum)} and at most {_fmt(maximum)}"
        raise InvalidConfig(f"{option} must be {unit}, {bounds}, got {value!r}")
    return float(value)


def _fmt(bound: float) -> str:
    """A bound as people write it: 3155760000, 1e-06."""
    return str(int(bound)) if float(bound).is_integer() else f"{bound:.12g}"


def is_exclusive(cost: int | None) -> bool:
    """Whether an attempt of this cost holds its whole key (``concurrency_mode="exclusive"``)."""
    return cost is not None and cost >= EXCLUSIVE_COST


def tokens_of(cost: int) -> int:
    """Rate tokens an attempt of this cost takes: an exclusive attempt takes one, like a start."""
    return 1 if is_exclusive(cost) else cost
