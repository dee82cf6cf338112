"""Overrides: an operator's runtime limit for a name (table ``keyed_overrides``), with an audit trail
(``keyed_override_log``).

0 pauses a name. An override takes effect at the next claim (the claim statement reads it through
``keyed_effective_limit``); lowering never preempts running attempts; raising or clearing promotes waiters
in the same transaction (D2). Every function runs in the caller's transaction, so an override can commit or
roll back together with the caller's own work (DESIGN §3.7). The overrides of single keys (a key's own pause or limit)
are ``key_overrides.py``; both write the audit trail through ``OVERRIDE_LOG_INSERT``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger.attempts import Promotion
from celery_keyed.ledger.bounds import SLOT_LIMIT_MAX
from celery_keyed.ledger.clock import NOW
from celery_keyed.ledger.errors import InvalidConfig
from celery_keyed.ledger.keyspec import validate_name
from celery_keyed.ledger.operator_input import check_audit_text, check_expiry
from celery_keyed.ledger.promote import DEFAULT_DISPATCH_TIMEOUT, promote_name

# overrides_lock: the current override of a name, locked, for the audit's "old" value. (A CTE in the upsert
# cannot read it: the row the statement itself updates is invisible to its own FOR UPDATE, so it read NULL.)
OVERRIDES_LOCK = sa.text("SELECT slot_limit FROM keyed_overrides WHERE name = :name FOR UPDATE")

# overrides_set: create or replace the override of a name.
OVERRIDES_SET = sa.text(
    f"""
    INSERT INTO keyed_overrides (name, slot_limit, reason, author, expires_at, set_at)
    VALUES (:name, :limit, :reason, :author, :expires_at, {NOW})
    ON CONFLICT (name) DO UPDATE SET slot_limit = excluded.slot_limit, reason = excluded.reason,
        author = excluded.author, expires_at = excluded.expires_at, set_at = excluded.set_at
    """
)

# overrides_clear: remove the override of a name; no row = there was none.
OVERRIDES_CLEAR = sa.text("DELETE FROM keyed_overrides WHERE name = :name RETURNING slot_limit")

# overrides_delete_expired: overrides whose expiry passed (the sweep logs and promotes for each).
OVERRIDES_DELETE_EXPIRED = sa.text(
    f"""
    DELETE FROM keyed_overrides o USING (
        SELECT name FROM keyed_overrides WHERE expires_at <= {NOW} FOR UPDATE SKIP LOCKED) v
     WHERE o.name = v.name
    RETURNING o.name, o.slot_limit
    """
)

# override_log_insert: one row of the audit trail; ``key`` NULL for a name's override, the key for a key's (0014).
OVERRIDE_LOG_INSERT = sa.text(
    f"""
    INSERT INTO keyed_override_log (name, key, action, old_limit, new_limit, reason, author, expires_at, at)
    VALUES (:name, CAST(:key AS text), :action, :old_limit, :new_limit, :reason, :author, :expires_at, {NOW})
    """
)

# overrides_get: the override of a name as stored (``celery keyed`` shows it).
OVERRIDES_GET = sa.text(
    "SELECT name, slot_limit, reason, author, expires_at, set_at FROM keyed_overrides WHERE name = :name"
)


def set_override(
    conn: sa.Connection,
    name: str,
    limit: int,
    *,
    reason: str,
    author: str = "",
    expires_at: datetime | None = None,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: datetime | None = None,
) -> list[Promotion]:
    """Set the runtime limit of ``name`` (0 pauses) in the caller's transaction; returns the promotions a
    raised limit made (the caller dispatches them after commit)."""
    validate_name(name)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= SLOT_LIMIT_MAX:
        raise InvalidConfig(
            f"{name}: an override limit must be a non-negative integer (0 pauses), at most {SLOT_LIMIT_MAX},"
            f" got {limit!r}"
        )
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidConfig("an override needs a reason")
    check_audit_text(reason, "the reason")
    check_audit_text(author, "the author")
    expires_at = check_expiry(expires_at)
    params = {
        "name": name,
        "limit": limit,
        "reason": reason,
        "author": author,
        "expires_at": expires_at,
        "now": now,
    }
    old = conn.execute(OVERRIDES_LOCK, {"name": name}).scalar_one_or_none()
    conn.execute(OVERRIDES_SET, params)
    conn.execute(
        OVERRIDE_LOG_INSERT, {**params, "key": None, "action": "set", "old_limit": old, "new_limit": limit}
    )
    return promote_name(conn, name, dispatch=dispatch, now=now)


def clear_override(
    conn: sa.Connection,
    name: str,
    *,
    reason: str = "",
    author: str = "",
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: datetime | None = None,
) -> list[Promotion]:
    """Remove the override of ``name``; the configured limit applies again at once."""
    validate_name(name)
    check_audit_text(reason, "the reason")
    check_audit_text(author, "the author")
    old = conn.execute(OVERRIDES_CLEAR, {"name": name}).scalar_one_or_none()
    if old is None:
        return []
    conn.execute(
        OVERRIDE_LOG_INSERT,
        {
            "name": name,
            "key": None,
            "action": "clear",
            "old_limit": old,
            "new_limit": None,
            "reason": reason,
            "author": author,
            "expires_at": None,
            "now": now,
        },
    )
    return promote_name(conn, name, dispatch=dispatch, now=now)


def expire_overrides(
    conn: sa.Connection, *, dispatch: float = DEFAULT_DISPATCH_TIMEOUT, now: datetime | None = None
) -> list[Promotion]:
    """Lapse overrides past their expiry (sweep), logging each and promoting what the change allows."""
    promotions: list[Promotion] = []
    for row in conn.execute(OVERRIDES_DELETE_EXPIRED, {"now": now}).all():
        conn.execute(
            OVERRIDE_LOG_INSERT,
            {
                "name": row.name,
                "key": None,
                "action": "expire",
                "old_limit": row.slot_limit,
                "new_limit": None,
                "reason": "expired",
                "author": "",
                "expires_at": None,
                "now": now,
            },
        )
        promotions += promote_name(conn, row.name, dispatch=dispatch, now=now)
    return promotions


def override_get(conn: sa.Connection, name: str) -> sa.Row[Any] | None:
    return conn.execute(OVERRIDES_GET, {"name": name}).first()
