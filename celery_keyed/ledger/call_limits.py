"""Limits computed from the call: the limit of a key that its latest arrival computed from the call's arguments
(a task's ``concurrency_limit``), stored with the key (table ``keyed_call_limits``).

``keyed_key_limit`` reads it after the operators' overrides and before the name's configured limit: a key's own
pause or limit (``celery keyed pause-key`` / ``set-key-limit``) wins, then a live override of its name (a paused
name pauses every key), then the call's limit, then ``keyed_concurrency_limits``. When two calls of one key
disagree, the key's limit is the one its latest arrival carried (the last one the ledger admitted, parked or turned
away): a raise gives its room to the key's line at once, in the arrival's transaction (D2); a lowered limit lets the
attempts running finish and starts nothing while the key is at or above it, as a lowered name limit does.

Only the general admission path writes it (``admit.admit``), in the arrival's transaction before the key's slot rows
are locked; no other statement locks these rows, so they take no place in the lock order of claims and releases.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger.bounds import SLOT_LIMIT_MAX, check_int
from celery_keyed.ledger.clock import NOW
from celery_keyed.ledger.keyspec import key_name

# call_limits_store: the key's limit as this arrival computed it. A value that did not change is not written again
# (no WAL on the hot path of a steady key) except to refresh seen_at once an hour, which keeps reconcile from
# pruning the row of a key still in use (ON CONFLICT ... DO UPDATE locks the row either way, so a prune racing the
# arrival waits for it and re-checks seen_at).
CALL_LIMITS_STORE = sa.text(
    f"""
    INSERT INTO keyed_call_limits AS l (key, name, slot_limit, set_at, task_id, seen_at)
    VALUES (:key, :name, :limit, {NOW}, :task_id, {NOW})
    ON CONFLICT (key) DO UPDATE
       SET slot_limit = excluded.slot_limit,
           set_at = CASE WHEN l.slot_limit = excluded.slot_limit THEN l.set_at ELSE excluded.set_at END,
           task_id = CASE WHEN l.slot_limit = excluded.slot_limit THEN l.task_id ELSE excluded.task_id END,
           seen_at = excluded.seen_at
     WHERE l.slot_limit <> excluded.slot_limit OR l.seen_at < excluded.seen_at - interval '1 hour'
    """
)

# call_limits_prune: the rows no arrival carried since :cutoff whose keys hold nothing and have nobody waiting.
CALL_LIMITS_PRUNE = sa.text(
    f"""
    DELETE FROM keyed_call_limits l
     WHERE l.seen_at < {NOW} - make_interval(secs => :seconds)
       AND NOT EXISTS (SELECT 1 FROM keyed_slots s WHERE s.key = l.key AND s.used > 0)
       AND NOT EXISTS (SELECT 1 FROM keyed_waiting w WHERE w.key = l.key)
    """
)

# call_limits_get: a key's limit from its latest call, who set it and when, and whether it is the key's limit now
# (no live override of the key or of its name, the name not configured to 0: keyed_key_limit's order).
CALL_LIMITS_GET = sa.text(
    f"""
    SELECT l.slot_limit, l.set_at, l.task_id,
           NOT EXISTS (SELECT 1 FROM keyed_overrides o WHERE o.name = l.name
                          AND (o.expires_at IS NULL OR o.expires_at > {NOW}))
           AND NOT EXISTS (SELECT 1 FROM keyed_key_overrides k WHERE k.key = l.key
                              AND (k.paused_until > {NOW}
                                   OR (k.slot_limit IS NOT NULL AND (k.expires_at IS NULL OR k.expires_at > {NOW}))))
           AND COALESCE((SELECT c.slot_limit FROM keyed_names c WHERE c.name = l.name), 1) > 0 AS in_effect
      FROM keyed_call_limits l WHERE l.key = :key
    """
)


@dataclass(frozen=True)
class CallLimit:
    """A key's limit as its latest call computed it: ``limit``, set by task ``task_id`` at ``set_at``; ``in_effect``:
    whether it is the key's limit now (no operator's override of the key or of its name wins over it)."""

    key: str
    limit: int
    set_at: datetime
    task_id: str
    in_effect: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: The shortest time a key's limit from the call is kept after its last arrival, whatever the books' retention.
PRUNE_AFTER_MIN = 86400.0


def check_call_limit(value: object, option: str = "concurrency_limit") -> int:
    """A limit computed from a call: an integer from 0 (the key's attempts wait) to ``SLOT_LIMIT_MAX``
    (``InvalidConfig`` otherwise)."""
    return check_int(value, option, maximum=SLOT_LIMIT_MAX)


def store(conn: sa.Connection, key: str, limit: int, *, task_id: str, now: datetime | None = None) -> None:
    """Store ``limit`` as ``key``'s limit from its latest call (the caller's transaction; before the key's slot rows
    are locked)."""
    conn.execute(CALL_LIMITS_STORE, {"key": key, "name": key_name(key), "limit": limit, "task_id": task_id, "now": now})


def get(conn: sa.Connection, key: str, *, now: datetime | None = None) -> CallLimit | None:
    """``key``'s limit from its latest call, or None when no call of it computed one (read only)."""
    row = conn.execute(CALL_LIMITS_GET, {"key": key, "now": now}).first()
    if row is None:
        return None
    return CallLimit(key, int(row.slot_limit), row.set_at, row.task_id, bool(row.in_effect))


def prune(conn: sa.Connection, *, idle: float, now: datetime | None = None) -> int:
    """Delete the limits of keys that hold nothing, have nobody waiting, and that no arrival carried for ``idle``
    seconds (at least a day); how many."""
    params = {"seconds": max(idle, PRUNE_AFTER_MIN), "now": now}
    return conn.execute(CALL_LIMITS_PRUNE, params).rowcount or 0
