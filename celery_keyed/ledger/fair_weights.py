"""Fair weights: how a ``fair`` name's slots are shared among its fair keys (tables ``keyed_fair_weight_overrides``
and ``keyed_fair_weight_log``, migration 0016).

While several fair keys of a key wait, promotion gives the next free slot to the head of the fair key with the
lowest load = (slots it holds of the key) / weight, ties by priority then arrival (``waiting.WAITING_NEXT_FAIR``),
so each waiting fair key's share of the key's slots follows its weight, and a fair key holding more than its
weighted share gets no new slot while another waits below its share. The weight of a fair key is decided in
Postgres by ``keyed_fair_weight(name, fair_key, call's weight, now)``: a live runtime override (longest matching
prefix), else the weight the head's call carries (``fair_weight`` task option / header), else the name's configured
table (``keyed_fair_weights`` setting, stored in ``keyed_names.fair_weights``; longest matching prefix), else 1.
A prefix matches a fair key equal to it or starting with it followed by ``:``.

A weight override changes no room, so it promotes nothing: it takes effect at the next promotion of the key.
Every function runs in the caller's transaction and logs what it changed, like limit overrides (overrides.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger.clock import NOW
from celery_keyed.ledger.errors import InvalidConfig, InvalidKey
from celery_keyed.ledger.keyspec import validate_key, validate_name
from celery_keyed.ledger.operator_input import check_audit_text, check_expiry

#: The range of a fair weight (a positive number; the ratio of two weights is what counts).
FAIR_WEIGHT_MIN = 0.001
FAIR_WEIGHT_MAX = 1_000_000.0


def check_weight(value: Any, what: str) -> float:
    """A fair weight as a float, or ``InvalidConfig`` naming ``what``: a finite number from FAIR_WEIGHT_MIN to
    FAIR_WEIGHT_MAX (bool refused)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidConfig(f"{what}: a fair weight must be a positive number, got {value!r}")
    if not FAIR_WEIGHT_MIN <= value <= FAIR_WEIGHT_MAX:
        raise InvalidConfig(
            f"{what}: a fair weight must be from {FAIR_WEIGHT_MIN} to {FAIR_WEIGHT_MAX:,.0f}, got {value!r}"
        )
    return float(value)


def check_prefix(prefix: Any, what: str) -> str:
    """A fair-key prefix: a key-shaped string (``InvalidConfig`` otherwise)."""
    if not isinstance(prefix, str):
        raise InvalidConfig(f"{what}: a fair-key prefix must be a str, got {prefix!r}")
    try:
        return validate_key(prefix)
    except InvalidKey as exc:
        raise InvalidConfig(f"{what}: fair-key prefix {prefix!r}: {exc}") from None


def check_weights(table: Any, what: str) -> dict[str, float]:
    """A table of weights by fair-key prefix (``{"tenant:big": 3, "tenant": 1}``), checked."""
    if not isinstance(table, Mapping):
        raise InvalidConfig(f"{what}: fair weights must be a dict of fair-key prefix -> weight, got {table!r}")
    checked: dict[str, float] = {}
    for prefix, weight in table.items():
        checked[check_prefix(prefix, what)] = check_weight(weight, f"{what} {prefix!r}")
    return checked


# fair_weight_lock: the current override of (name, prefix), locked, for the audit's "old" value.
FAIR_WEIGHT_LOCK = sa.text(
    "SELECT weight FROM keyed_fair_weight_overrides WHERE name = :name AND prefix = :prefix FOR UPDATE"
)

# fair_weight_set: create or replace the weight override of the fair keys of a name matching a prefix.
FAIR_WEIGHT_SET = sa.text(
    f"""
    INSERT INTO keyed_fair_weight_overrides (name, prefix, weight, reason, author, expires_at, set_at)
    VALUES (:name, :prefix, :weight, :reason, :author, :expires_at, {NOW})
    ON CONFLICT (name, prefix) DO UPDATE SET weight = excluded.weight, reason = excluded.reason,
        author = excluded.author, expires_at = excluded.expires_at, set_at = excluded.set_at
    """
)

# fair_weight_clear: remove a weight override; no row = there was none.
FAIR_WEIGHT_CLEAR = sa.text(
    "DELETE FROM keyed_fair_weight_overrides WHERE name = :name AND prefix = :prefix RETURNING weight"
)

# fair_weight_delete_expired: weight overrides whose expiry passed (the sweep logs each). keyed_fair_weight ignores
# them already; this only tidies the table and writes the audit row.
FAIR_WEIGHT_DELETE_EXPIRED = sa.text(
    f"""
    DELETE FROM keyed_fair_weight_overrides o USING (
        SELECT name, prefix FROM keyed_fair_weight_overrides WHERE expires_at <= {NOW} FOR UPDATE SKIP LOCKED) v
     WHERE o.name = v.name AND o.prefix = v.prefix
    RETURNING o.name, o.prefix, o.weight
    """
)

FAIR_WEIGHT_LOG_INSERT = sa.text(
    f"""
    INSERT INTO keyed_fair_weight_log (name, prefix, action, old_weight, new_weight, reason, author, expires_at, at)
    VALUES (:name, :prefix, :action, :old_weight, :new_weight, :reason, :author, :expires_at, {NOW})
    """
)

# fair_weight_list: the live weight overrides (of one name, or all), as stored.
FAIR_WEIGHT_LIST = sa.text(
    f"""
    SELECT name, prefix, weight, reason, author, expires_at, set_at FROM keyed_fair_weight_overrides
     WHERE (CAST(:name AS text) IS NULL OR name = :name) AND (expires_at IS NULL OR expires_at > {NOW})
     ORDER BY name, prefix
    """
)

# fair_shares: per key of a fair name and fair key that holds or waits: slots held, attempts waiting, the weight
# (keyed_fair_weight over the head's call weight), the load that orders promotion, and the weighted share of the
# key's limit (keyed_key_limit: its own, else its name's) among the fair keys of the key that hold or wait. Read only.
FAIR_SHARES = sa.text(
    f"""
    WITH fair AS (
        SELECT name FROM keyed_names WHERE fair AND (CAST(:name AS text) IS NULL OR name = :name)
    ), held AS (
        SELECT c.key, c.fair_key, sum(c.cost) AS holding FROM keyed_claims c
         WHERE c.key IN (SELECT DISTINCT s.key FROM keyed_slots s JOIN fair f ON f.name = s.name
                          WHERE CAST(:key AS text) IS NULL OR s.key = :key)
         GROUP BY c.key, c.fair_key
    ), waits AS (
        SELECT DISTINCT ON (w.key, w.fair_key) w.key, w.fair_key, w.fair_weight,
               count(*) OVER (PARTITION BY w.key, w.fair_key) AS waiting
          FROM keyed_waiting w
         WHERE w.key IN (SELECT k.key FROM keyed_keys k JOIN fair f ON f.name = k.name
                          WHERE k.waiting > 0 AND (CAST(:key AS text) IS NULL OR k.key = :key))
           AND NOT w.shadow
         ORDER BY w.key, w.fair_key, w.priority DESC, w.arrival
    ), both_ AS (
        SELECT COALESCE(h.key, w.key) AS key, COALESCE(h.fair_key, w.fair_key) AS fair_key,
               COALESCE(h.holding, 0) AS holding, COALESCE(w.waiting, 0) AS waiting,
               keyed_fair_weight(split_part(COALESCE(h.key, w.key), ':', 1), COALESCE(h.fair_key, w.fair_key),
                                 w.fair_weight, {NOW}) AS weight
          FROM held h FULL JOIN waits w ON w.key = h.key AND w.fair_key IS NOT DISTINCT FROM h.fair_key
    )
    SELECT key, fair_key, holding, waiting, weight, holding / weight AS load,
           keyed_key_limit(key, {NOW}) * weight / sum(weight) OVER (PARTITION BY key) AS share
      FROM both_
     ORDER BY key, load, fair_key NULLS FIRST
     LIMIT :limit
    """
)


@dataclass(frozen=True)
class FairShare:
    """One fair key of one key of a fair name: slots it holds, attempts it has waiting, its weight, its load
    (holding / weight: the lowest waiting load is promoted next) and its weighted share of the key's limit among
    the fair keys that hold or wait (``limit * weight / sum of their weights``)."""

    key: str
    fair_key: str | None
    holding: int
    waiting: int
    weight: float
    load: float
    share: float

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def fair_shares(
    conn: sa.Connection,
    *,
    name: str | None = None,
    key: str | None = None,
    limit: int = 200,
    now: datetime | None = None,
) -> list[FairShare]:
    """Who holds and waits under each key of the fair names (one name, one key, or all), by key then load."""
    rows = conn.execute(FAIR_SHARES, {"name": name, "key": key, "limit": limit, "now": now}).mappings()
    return [
        FairShare(
            key=r["key"],
            fair_key=r["fair_key"],
            holding=int(r["holding"]),
            waiting=int(r["waiting"]),
            weight=float(r["weight"]),
            load=float(r["load"]),
            share=float(r["share"]),
        )
        for r in rows
    ]


def set_fair_weight(
    conn: sa.Connection,
    name: str,
    prefix: str,
    weight: float,
    *,
    reason: str,
    author: str = "",
    expires_at: datetime | None = None,
    now: datetime | None = None,
) -> None:
    """Set the runtime weight of the fair keys of ``name`` matching ``prefix`` (equal to it, or starting with it
    and ``:``), in the caller's transaction, with an audit row. It wins over the call's weight and the configured
    table from the next promotion on."""
    validate_name(name)
    check_prefix(prefix, name)
    checked = check_weight(weight, f"{name} {prefix}")
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidConfig("a fair weight override needs a reason")
    check_audit_text(reason, "the reason")
    check_audit_text(author, "the author")
    expires_at = check_expiry(expires_at)
    params = {
        "name": name,
        "prefix": prefix,
        "weight": checked,
        "reason": reason,
        "author": author,
        "expires_at": expires_at,
        "now": now,
    }
    old = conn.execute(FAIR_WEIGHT_LOCK, {"name": name, "prefix": prefix}).scalar_one_or_none()
    conn.execute(FAIR_WEIGHT_SET, params)
    conn.execute(FAIR_WEIGHT_LOG_INSERT, {**params, "action": "set", "old_weight": old, "new_weight": checked})


def clear_fair_weight(
    conn: sa.Connection, name: str, prefix: str, *, reason: str = "", author: str = "", now: datetime | None = None
) -> bool:
    """Remove the weight override of (``name``, ``prefix``); False when there was none."""
    validate_name(name)
    check_prefix(prefix, name)
    check_audit_text(reason, "the reason")
    check_audit_text(author, "the author")
    old = conn.execute(FAIR_WEIGHT_CLEAR, {"name": name, "prefix": prefix}).scalar_one_or_none()
    if old is None:
        return False
    conn.execute(
        FAIR_WEIGHT_LOG_INSERT,
        {
            "name": name,
            "prefix": prefix,
            "action": "clear",
            "old_weight": old,
            "new_weight": None,
            "reason": reason,
            "author": author,
            "expires_at": None,
            "now": now,
        },
    )
    return True


def expire_fair_weights(conn: sa.Connection, *, now: datetime | None = None) -> int:
    """Drop weight overrides past their expiry (the sweep), logging each; how many."""
    rows = conn.execute(FAIR_WEIGHT_DELETE_EXPIRED, {"now": now}).all()
    for row in rows:
        conn.execute(
            FAIR_WEIGHT_LOG_INSERT,
            {
                "name": row.name,
                "prefix": row.prefix,
                "action": "expire",
                "old_weight": row.weight,
                "new_weight": None,
                "reason": "expired",
                "author": "",
                "expires_at": None,
                "now": now,
            },
        )
    return len(rows)


def fair_weight_overrides(
    conn: sa.Connection, name: str | None = None, *, now: datetime | None = None
) -> list[sa.Row[Any]]:
    return list(conn.execute(FAIR_WEIGHT_LIST, {"name": name, "now": now}))
