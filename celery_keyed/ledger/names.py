"""Names: the configured limit and waiting room of every key ``name:*`` (table ``keyed_names``).

Configuration lives in the application's settings; a worker syncs it here at start (``names_upsert``) so
that the claim statement reads it inside Postgres (``keyed_effective_limit``) together with overrides.
A name with no row is a mutex (K = 1) with an unbounded waiting room.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import sqlalchemy as sa

from celery_keyed.ledger.attempts import check_debounce, check_on_newer
from celery_keyed.ledger.bounds import (
    BURST_MAX,
    MAX_WAITING_MAX,
    RATE_MAX,
    RATE_MIN,
    SHARDS_MAX,
    SLOT_LIMIT_MAX,
    WINDOW_STARTS_MAX,
    WINDOWS_MAX,
    check_int,
    check_number,
    check_seconds,
)
from celery_keyed.ledger.caps import cap_key
from celery_keyed.ledger.clock import NOW
from celery_keyed.ledger.errors import InvalidConfig
from celery_keyed.ledger.fair_weights import check_weights
from celery_keyed.ledger.keyspec import validate_name

Overflow = Literal["reject", "supersede"]
#: What a group of the name does when its head fails (docs/groups.md): wait through its retries and move on after its
#: final failure (halt), dead-letter it at once and move on (skip), or wait for an operator (hold).
GroupFailure = Literal["halt", "skip", "hold"]
GROUP_FAILURE_POLICIES: tuple[str, ...] = ("halt", "skip", "hold")

_KNOWN_OPTIONS = {
    "limit", "shards", "max_waiting", "max_wait", "overflow", "uncertain_hold", "rate", "burst", "windows", "fair",
    "fair_weights", "cap", "borrow",
    "admit_at_send", "register_at_publish",
    "debounce", "debounce_max", "debounce_keep",
    "on_newer",
    "group_failure",
}
_PER = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


@dataclass(frozen=True)
class NameConfig:
    """The configuration of one name. ``limit`` slots per key; ``shards`` counter rows per key (D12);
    ``max_waiting`` parked attempts per key (None = unbounded); ``max_wait`` seconds from arrival to the
    latest start (None = no bound); ``overflow`` what a full waiting room does with a new arrival;
    ``uncertain_hold`` seconds a slot stays held after a hard time limit or a lost worker (None = released at
    once), because the remote call may still be running; ``rate`` starts per second allowed per key (a token
    bucket; settings also take "100/m", "6/s", "500/h", "1000/d"), ``burst`` the tokens a key can save up (default 1);
    ``windows``: rate windows per key, at most N starts in any window of T seconds for every window given, as
    ``[(N, T), ...]`` or ``["100/m", "10000/d", "5/10s"]`` (beside or instead of ``rate``: a start takes from all of
    them or none); ``cap``: at most that many slots held by all the keys of the name together (every task of a key of
    the name also takes a slot of its name's cap key, ``caps.cap_key``); ``borrow``: while no task waits for the cap,
    a key may hold up to the cap instead of its own limit (it returns to its limit for new starts once one waits);
    ``fair``: waiters share a key's slots round-robin by their fair key instead of one FIFO line;
    ``fair_weights``: a fair name's weights by fair-key prefix (``{"tenant:big": 3}``; default 1): while several
    fair keys wait, each one's share of a key's slots follows its weight (ledger/fair_weights.py);
    ``admit_at_send``: producers ask the ledger before publishing a task of this name and raise ``KeyedRejected``
    when its waiting room is full or its dedupe key is live (read by the producer from its own settings; not
    stored in the ledger); ``register_at_publish``: producers store each message of this name in the ledger's
    outbox at publish, and what no worker receives in time is published again (producer side too);
    ``group_failure``: what a group whose key has this name does when its head fails — ``"halt"`` (the default: the
    group waits through the head's retries and moves on once its final failure is dead-lettered), ``"skip"`` (the
    head is dead-lettered at its first failure, retry or not, and the next member starts at once), ``"hold"`` (the
    group waits for an operator: ``Ledger.resume_group`` / ``Ledger.skip_group_head``)."""

    name: str
    limit: int = 1
    shards: int = 1
    max_waiting: int | None = None
    max_wait: float | None = None
    overflow: Overflow = "reject"
    uncertain_hold: float | None = None
    rate: float | None = None
    burst: float | None = None
    windows: tuple[tuple[int, float], ...] | None = None
    cap: int | None = None
    borrow: bool = False
    fair: bool = False
    fair_weights: Mapping[str, float] | None = None
    admit_at_send: bool = False
    register_at_publish: bool = False
    # Debounce (producer side, like admit_at_send: not stored in the ledger): a task of this name
    # without its own debounce option is published debounced (docs/features.md "Debounce").
    debounce: float | None = None
    debounce_max: float | None = None
    debounce_keep: str = "last"
    # Newest wins (producer side, like debounce: not stored in the ledger): a task of this name
    # without its own on_newer option is published with this policy ("cancel_running"; docs/features.md "Newest wins").
    on_newer: str | None = None
    # Group failure policies: stored in the ledger, read by the release of a group's head.
    group_failure: GroupFailure = "halt"

    def __post_init__(self) -> None:
        # Every number is checked against what its column and the clock can hold (ledger/bounds.py), so a value
        # out of range fails here, at configuration time, naming the name and the option.
        validate_name(self.name)
        self._check_room()
        self._check_rate()
        self._check_flags()
        self._check_producer_side()

    def _check_room(self) -> None:
        """The limit, shards, waiting room size and durations."""
        check_int(self.limit, f"{self.name}: limit", maximum=SLOT_LIMIT_MAX)
        check_int(self.shards, f"{self.name}: shards", minimum=1, maximum=SHARDS_MAX)
        if self.max_waiting is not None:
            check_int(self.max_waiting, f"{self.name}: max_waiting", maximum=MAX_WAITING_MAX)
        for option in ("max_wait", "uncertain_hold"):
            if getattr(self, option) is not None:
                check_seconds(getattr(self, option), f"{self.name}: {option}")

    def _check_rate(self) -> None:
        """The token bucket (a rate given as "100/m" is parsed here)."""
        if isinstance(self.rate, str):
            object.__setattr__(self, "rate", parse_rate(self.name, self.rate))
        if self.rate is not None:
            check_number(self.rate, f"{self.name}: rate", minimum=RATE_MIN, maximum=RATE_MAX,
                         unit="a number of starts per second (or like '100/m')")
        if self.burst is not None and self.rate is None:
            raise InvalidConfig(f"{self.name}: burst needs a rate")
        if self.burst is not None:
            check_number(self.burst, f"{self.name}: burst", minimum=1, maximum=BURST_MAX, unit="a number of tokens")
        object.__setattr__(self, "windows", parse_windows(self.name, self.windows))
        if self.cap is not None:
            check_int(self.cap, f"{self.name}: cap", minimum=1, maximum=SLOT_LIMIT_MAX)
        if not isinstance(self.borrow, bool):
            raise InvalidConfig(f"{self.name}: borrow must be True or False, got {self.borrow!r}")
        if self.borrow and self.cap is None:
            raise InvalidConfig(f"{self.name}: borrow needs a cap (the most all its keys may hold together)")

    def _check_flags(self) -> None:
        """Fairness and its weights, the producer-side switches, the overflow policy."""
        if not isinstance(self.fair, bool):
            raise InvalidConfig(f"{self.name}: fair must be True or False, got {self.fair!r}")
        if self.fair_weights is not None:
            if not self.fair:
                raise InvalidConfig(f"{self.name}: fair_weights need fair=True (weights share a fair name's slots)")
            object.__setattr__(self, "fair_weights", check_weights(self.fair_weights, f"{self.name}: fair_weights"))
        if not isinstance(self.admit_at_send, bool):
            raise InvalidConfig(f"{self.name}: admit_at_send must be True or False, got {self.admit_at_send!r}")
        if not isinstance(self.register_at_publish, bool):
            raise InvalidConfig(
                f"{self.name}: register_at_publish must be True or False, got {self.register_at_publish!r}"
            )
        if self.overflow not in ("reject", "supersede"):
            raise InvalidConfig(f"{self.name}: overflow must be 'reject' or 'supersede', got {self.overflow!r}")
        if self.group_failure not in GROUP_FAILURE_POLICIES:
            raise InvalidConfig(
                f"{self.name}: group_failure must be 'halt', 'skip' or 'hold', got {self.group_failure!r}"
            )

    def _check_producer_side(self) -> None:
        """Debounce and newest wins (producer-side policies, not stored in the ledger)."""
        if self.debounce is not None or self.debounce_max is not None or self.debounce_keep != "last":
            try:
                check_debounce(self.debounce, self.debounce_max, self.debounce_keep)
            except ValueError as exc:
                raise InvalidConfig(f"{self.name}: {exc}") from None
        try:
            check_on_newer(self.on_newer)
        except ValueError as exc:
            raise InvalidConfig(f"{self.name}: {exc}") from None
        if self.on_newer is not None and self.debounce is not None:
            raise InvalidConfig(f"{self.name}: on_newer and debounce do not combine")

    @classmethod
    def from_setting(cls, name: str, value: Any) -> NameConfig:
        """Build from a settings entry: an int (the limit) or a dict with keys limit, shards, max_waiting,
        max_wait, overflow. Unknown keys are an error (a typo must not silently turn a gate into a mutex)."""
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(name=name, limit=value)
        if not isinstance(value, Mapping):
            raise InvalidConfig(f"{name}: a limit setting must be an int or a dict, got {type(value).__name__}")
        unknown = set(value) - _KNOWN_OPTIONS
        if unknown:
            raise InvalidConfig(f"{name}: unknown option(s) {sorted(unknown)}; known: {sorted(_KNOWN_OPTIONS)}")
        return cls(name=name, **dict(value))


def parse_rate(name: str, value: Any) -> float:
    """A rate as starts per second: a number (per second) or "N/s", "N/m", "N/h"."""
    if isinstance(value, str):
        count, _, per = value.strip().partition("/")
        try:
            number = float(count)
        except ValueError:
            number = math.nan
        if per.strip() not in _PER or not math.isfinite(number) or number <= 0:
            raise InvalidConfig(f"{name}: rate must be a positive number per second or like '100/m', got {value!r}")
        return number / _PER[per.strip()]
    return value  # checked as a positive number by NameConfig


def parse_windows(name: str, value: Any) -> tuple[tuple[int, float], ...] | None:
    """Rate windows as ``((N, seconds), ...)``, shortest window first: each entry a pair ``(N, seconds)`` or a string
    "N/unit" ("100/m", "10000/d") or "N/<count><unit>" ("5/10s"); None (or empty) for none."""
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise InvalidConfig(f"{name}: windows must be a list like ['100/m', '10000/d'] or [(100, 60)], got {value!r}")
    if len(value) > WINDOWS_MAX:
        raise InvalidConfig(f"{name}: windows takes at most {WINDOWS_MAX} windows, got {len(value)}")
    parsed = []
    for entry in value:
        if isinstance(entry, str):
            count, seconds = _parse_window_text(name, entry)
        elif isinstance(entry, list | tuple) and len(entry) == 2:
            count, seconds = entry
        else:
            raise InvalidConfig(f"{name}: a window is 'N/unit' (like '100/m') or a pair (N, seconds), got {entry!r}")
        count = check_int(count, f"{name}: a window's N (starts allowed)", minimum=1, maximum=WINDOW_STARTS_MAX)
        seconds = check_seconds(seconds, f"{name}: a window's length")
        parsed.append((count, seconds))
    if len({seconds for _, seconds in parsed}) < len(parsed):
        raise InvalidConfig(f"{name}: two windows of the same length: keep the one with the smaller N")
    return tuple(sorted(parsed, key=lambda w: w[1])) or None


def _parse_window_text(name: str, text: str) -> tuple[Any, float]:
    """"100/m" -> (100, 60.0); "5/10s" -> (5, 10.0)."""
    count, _, per = text.strip().partition("/")
    per = per.strip()
    unit = per[-1:]
    length = per[:-1].strip() or "1"
    try:
        seconds = float(length) * _PER[unit] if unit in _PER else math.nan
        number = int(count.strip())
    except ValueError:
        seconds, number = math.nan, -1
    if not math.isfinite(seconds) or number < 1:
        raise InvalidConfig(
            f"{name}: a window is 'N/unit' with N a whole number and unit s, m, h or d, optionally with a count"
            f" ('100/m', '5/10s'), got {text!r}"
        )
    return number, seconds


def parse_limits(setting: Mapping[str, Any] | None) -> dict[str, NameConfig]:
    """Parse a whole ``keyed_concurrency_limits`` setting into configs by name."""
    if setting is None:
        return {}
    if not isinstance(setting, Mapping):
        raise InvalidConfig(f"keyed_concurrency_limits must be a dict by name, got {type(setting).__name__}")
    return {name: NameConfig.from_setting(validate_name(name), value) for name, value in setting.items()}


# names_upsert: write one name's configuration (worker start, tests, admin), stamped with the configuration version
# of the writer (keyed_config_version). Rolling deploys: a writer with an older version never
# overwrites a row stored by a newer one (the ON CONFLICT guard, evaluated on the locked row), nor adds a name
# while the ledger holds any newer configuration (NOT EXISTS). No row returned = not written (a newer one rules).
NAMES_UPSERT = sa.text(
    f"""
    INSERT INTO keyed_names (name, slot_limit, shards, max_waiting, max_wait, overflow, uncertain_hold, rate, burst,
                             windows, cap, borrow, fair, fair_weights, group_failure, config_version, updated_at)
    SELECT :name, :limit, :shards, :max_waiting, :max_wait, :overflow, :uncertain_hold, :rate, :burst,
           CAST(:windows AS jsonb), :cap, :borrow, :fair, CAST(:fair_weights AS jsonb), :group_failure, :version, {NOW}
     WHERE NOT EXISTS (SELECT 1 FROM keyed_names n WHERE n.config_version > :version)
    ON CONFLICT (name) DO UPDATE SET
        slot_limit = excluded.slot_limit, shards = excluded.shards, max_waiting = excluded.max_waiting,
        max_wait = excluded.max_wait, overflow = excluded.overflow, uncertain_hold = excluded.uncertain_hold,
        rate = excluded.rate, burst = excluded.burst, windows = excluded.windows, cap = excluded.cap,
        borrow = excluded.borrow, fair = excluded.fair,
        fair_weights = excluded.fair_weights,
        group_failure = excluded.group_failure,
        config_version = excluded.config_version,
        updated_at = excluded.updated_at
     WHERE keyed_names.config_version <= excluded.config_version
    RETURNING name
    """
)

# names_cap_upsert: the name row of a name's cap key ("<name>#cap", caps.py): its limit is the cap. Written with
# the name's own row, under the same configuration version.
NAMES_CAP_UPSERT = sa.text(
    f"""
    INSERT INTO keyed_names (name, slot_limit, config_version, updated_at) VALUES (:name, :cap, :version, {NOW})
    ON CONFLICT (name) DO UPDATE SET slot_limit = excluded.slot_limit, config_version = excluded.config_version,
                                     updated_at = excluded.updated_at
    """
)
# names_cap_lift: a name without a cap any more: its cap key (if it has one) stops bounding the tasks that still hold
# or wait for it (new tasks do not take it).
NAMES_CAP_LIFT = sa.text(
    f"UPDATE keyed_names SET slot_limit = {SLOT_LIMIT_MAX}, config_version = :version, updated_at = {NOW}"
    f" WHERE name = :name AND slot_limit <> {SLOT_LIMIT_MAX}"
)

# names_newest_version: the highest configuration version stored (0 when no name is configured).
NAMES_NEWEST_VERSION = sa.text("SELECT COALESCE(max(config_version), 0) FROM keyed_names")

# names_largest_share: the most slots one claim can take on a key of each name (a shard's share of the
# configured limit; an override may lower it for a while, but the configuration is what can ever be had): an
# attempt that costs more is rejected instead of waiting for ever (D16).
# (:call_name, :call_key, :call_limit: the attempt's first key, of that name, whose limit its call computed, or else its
# latest call stored, in place of the configured one.)
NAMES_LARGEST_SHARE = sa.text(
    """
    SELECT n.name, LEAST(COALESCE(keyed_shard_share(
                             CASE WHEN n.name = :call_name
                                  THEN COALESCE(CAST(:call_limit AS integer),
                                                (SELECT l.slot_limit FROM keyed_call_limits l WHERE l.key = :call_key),
                                                c.slot_limit)
                                  ELSE c.slot_limit END, COALESCE(c.shards, 1), 0), 1),
                         CASE WHEN c.rate IS NOT NULL THEN CAST(floor(COALESCE(c.burst, 1)) AS integer) END,
                         (SELECT min(CAST(e ->> 0 AS integer)) FROM jsonb_array_elements(c.windows) AS e)) AS share
      FROM unnest(CAST(:names AS text[])) AS n(name) LEFT JOIN keyed_names c ON c.name = n.name
    """
)

# names_shards: the current shard count of a name (an exclusive attempt needs one: readers and writers).
NAMES_SHARDS = sa.text("SELECT keyed_name_shards(:name)")

# names_rated: which of these names have a token bucket (a promotion takes their tokens too: gate and rate both
# pass, or neither is debited, §3.10).
NAMES_RATED = sa.text("SELECT name FROM keyed_names WHERE name = ANY(:names) AND rated")

# names_overflow: what a full waiting room of this name does with a new arrival (reject or supersede, §3.6).
NAMES_OVERFLOW = sa.text("SELECT overflow FROM keyed_names WHERE name = :name")


def names_upsert(conn: sa.Connection, config: NameConfig, *, version: int = 0, now: datetime | None = None) -> bool:
    """Store ``config`` as configuration version ``version``; False when a newer version is stored (nothing
    written). Raising a limit creates room: the caller runs ``promote_name`` in the same transaction
    (``configure_names`` does)."""
    row = conn.execute(
        NAMES_UPSERT,
        {
            "name": config.name,
            "limit": config.limit,
            "shards": config.shards,
            "max_waiting": config.max_waiting,
            "max_wait": config.max_wait,
            "overflow": config.overflow,
            "uncertain_hold": config.uncertain_hold,
            "rate": config.rate,
            "burst": config.burst,
            "windows": None if config.windows is None else json.dumps([list(w) for w in config.windows]),
            "cap": config.cap,
            "borrow": config.borrow,
            "fair": config.fair,
            "fair_weights": None if config.fair_weights is None else json.dumps(dict(config.fair_weights)),
            "group_failure": config.group_failure,
            "version": version,
            "now": now,
        },
    ).first()
    if row is not None:
        params = {"name": cap_key(config.name), "cap": config.cap, "version": version, "now": now}
        conn.execute(NAMES_CAP_UPSERT if config.cap is not None else NAMES_CAP_LIFT, params)
    return row is not None


def names_newest_version(conn: sa.Connection) -> int:
    return int(conn.execute(NAMES_NEWEST_VERSION).scalar_one())
