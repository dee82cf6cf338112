"""Keys: one head row per concurrency key (table ``keyed_keys``) holding its waiting count.

Invariant (D1): ``waiting`` equals the number of ``keyed_waiting`` rows of the key; it changes only under
this row's lock, in the transaction that inserts or deletes those rows. ``max_waiting`` is enforced by the
guarded increment. Lock order: after the key's ``keyed_slots`` rows, before ``keyed_groups`` rows.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger.clock import NOW

# keys_ensure_locked: create the head row if missing and lock it (D2: lock unconditionally).
KEYS_LOCK = sa.text(
    f"""
    INSERT INTO keyed_keys (key, name, waiting, active_at) VALUES (:key, :name, 0, {NOW})
    ON CONFLICT (key) DO UPDATE SET active_at = excluded.active_at
    RETURNING waiting
    """
)

# keys_add_waiting: one more parked attempt, only while the waiting room has a place (max_waiting).
KEYS_ADD_WAITING = sa.text(
    """
    UPDATE keyed_keys k SET waiting = k.waiting + 1
     WHERE k.key = :key
       AND (:force OR k.waiting < COALESCE((SELECT c.max_waiting FROM keyed_names c WHERE c.name = k.name),
                                          2147483647))
    RETURNING k.waiting
    """
)

# keys_remove_waiting: n parked attempts left the waiting room (promoted, expired, superseded, revoked).
KEYS_REMOVE_WAITING = sa.text(
    f"UPDATE keyed_keys SET waiting = waiting - :n, active_at = {NOW} WHERE key = :key RETURNING waiting"
)

KEYS_SET_WAITING = sa.text("UPDATE keyed_keys SET waiting = :waiting WHERE key = :key")

# keys_of_name_waiting: keys of a name with parked attempts, in lock order (an override or a limit change promotes
# each, D2).
KEYS_OF_NAME_WAITING = sa.text("SELECT key FROM keyed_keys WHERE name = :name AND waiting > 0 ORDER BY key")

# keys_get_waiting: whether a key has parked attempts, read after the slot row's lock is held (a new snapshot: an
# attempt parked by a transaction that held that lock before us is seen, D2).
KEYS_GET_WAITING = sa.text("SELECT waiting FROM keyed_keys WHERE key = :key")

# keys_lock_nowait: the head row of a key for a step that holds locks later in the lock order (never waits: no
# row = busy, and the lock holder or the sweep does the work, D2).
KEYS_LOCK_NOWAIT = sa.text("SELECT waiting FROM keyed_keys WHERE key = :key FOR UPDATE SKIP LOCKED")

# keys_lock_existing: lock a key's head row if it exists (reconcile, after the key's slot rows: lock order), so the
# waiting count can be compared with the parked rows in a later statement (D1).
KEYS_LOCK_EXISTING = sa.text("SELECT waiting FROM keyed_keys WHERE key = :key FOR UPDATE")

# keys_idle: keys with nothing held or parked and no activity for :idle seconds (candidates; re-checked locked).
KEYS_IDLE = sa.text(
    f"""
    SELECT k.key FROM keyed_keys k
     WHERE k.waiting = 0 AND k.active_at < {NOW} - make_interval(secs => :idle)
       AND NOT EXISTS (SELECT 1 FROM keyed_slots s WHERE s.key = k.key AND s.used > 0)
     LIMIT :batch
    """
)

# keys_lock_idle: lock a key's head row only while it is still idle (nothing parked, no activity for :idle).
KEYS_LOCK_IDLE = sa.text(
    f"""
    SELECT waiting FROM keyed_keys WHERE key = :key AND waiting = 0
       AND active_at < {NOW} - make_interval(secs => :idle) FOR UPDATE
    """
)

# keys_drop_idle: delete the head row of a key with nothing parked (the caller holds its slot rows and head row).
KEYS_DROP_IDLE = sa.text("DELETE FROM keyed_keys WHERE key = :key AND waiting = 0")


def keys_lock(conn: sa.Connection, key: str, name: str, *, now: datetime | None = None) -> int:
    """Create (if missing) and lock the head row of ``key``; its waiting count."""
    return int(conn.execute(KEYS_LOCK, {"key": key, "name": name, "now": now}).scalar_one())


def keys_add_waiting(conn: sa.Connection, key: str, *, force: bool = False) -> bool:
    """Count one more parked attempt; False when the waiting room is full (and ``force`` is not set)."""
    return conn.execute(KEYS_ADD_WAITING, {"key": key, "force": force}).first() is not None


def keys_remove_waiting(conn: sa.Connection, key: str, n: int = 1, *, now: datetime | None = None) -> None:
    """Count ``n`` parked attempts fewer (the CHECK catches a removal without a park)."""
    conn.execute(KEYS_REMOVE_WAITING, {"key": key, "n": n, "now": now})


# keys_captured_by: keys of names seen while they were K = 1 identities (unconfigured or configured as 1), for the
# prefix-capture warning when those names get another limit (DESIGN §3.11).
KEYS_CAPTURED_BY = sa.text(
    """
    SELECT k.name, count(*) AS n, min(k.key) AS example FROM keyed_keys k
     WHERE k.name = ANY(:names)
       AND NOT EXISTS (SELECT 1 FROM keyed_names c WHERE c.name = k.name AND c.slot_limit <> 1)
     GROUP BY k.name ORDER BY k.name
    """
)


def keys_captured_by(conn: sa.Connection, names: list[str]) -> list[sa.Row[Any]]:
    return list(conn.execute(KEYS_CAPTURED_BY, {"names": names}))


# keys_take_tokens: the rate limit of a key (keyed_take_rate): its token bucket (names.rate / names.burst, refilled
# lazily) and its windows (names.windows), taken together if all of them let ``cost`` start now, under the key's
# head row lock (the caller holds it). Answers: the name has no rate (nothing to take); taken; else when they will.
KEYS_TAKE_TOKENS = sa.text("SELECT * FROM keyed_take_rate(:key, :name, :cost, CAST(:now AS timestamptz))")


def keys_take_tokens(conn: sa.Connection, key: str, name: str, cost: int = 1, *, now: datetime | None = None) -> Any:
    """Take what a start of ``cost`` needs from a rate-limited key — tokens of its bucket and positions in its
    windows, all or none (the caller holds the key's head row): a row with ``unrated`` (the name has neither),
    ``took`` and ``next_at`` (when not taken: the time all of them would let it)."""
    return conn.execute(KEYS_TAKE_TOKENS, {"key": key, "name": name, "cost": cost, "now": now}).one()
