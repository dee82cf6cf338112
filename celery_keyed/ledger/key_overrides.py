"""Key overrides: a runtime limit and / or a pause of ONE key, not its whole name (table ``keyed_key_overrides``,
migration 0014), audited in ``keyed_override_log`` (``key`` set) like the overrides of names (``overrides.py``).

- A key's own limit replaces its name's limit for that key (raise one tenant, throttle another) until its expiry.
- A pause stops every new start of the key until ``paused_until`` (running attempts go on, D3 §3.7: nothing is
  preempted); its waiters keep their places and are promoted when it ends. Pausing again extends a pause, never
  shortens it (several tasks hitting a 429 at once: the latest Retry-After wins); ``resume_key`` ends it at once.
- A paused name (effective limit 0) pauses every key, whatever its key override.

Every claim reads the key's limit inside Postgres (``keyed_key_limit``), so a change takes effect at the next claim
and both a pause and a limit stop applying by themselves at their time, with no cache and no timer; the sweep
(``lapse_key_overrides``) then clears them, logs it and promotes the key's waiters, within one sweep interval (D2).
Writers lock the key override row first (it comes before every other row in the lock order; claims only read it),
then promote in the same transaction (D2). Every function runs in the caller's transaction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import slots
from celery_keyed.ledger.attempts import Promotion
from celery_keyed.ledger.bounds import SLOT_LIMIT_MAX, check_seconds
from celery_keyed.ledger.clock import NOW
from celery_keyed.ledger.errors import InvalidConfig
from celery_keyed.ledger.keyspec import key_name, normalize_key
from celery_keyed.ledger.operator_input import check_audit_text, check_expiry
from celery_keyed.ledger.overrides import OVERRIDE_LOG_INSERT
from celery_keyed.ledger.promote import DEFAULT_DISPATCH_TIMEOUT, promote_key

#: SQL: the time a pause or an expiry given as an absolute time (:until) or as seconds from now (:seconds).
_UNTIL = (
    f"COALESCE(CAST(:until AS timestamptz), {NOW} + make_interval(secs => CAST(:seconds AS double precision)))"
)

# key_overrides_lock: the live parts of a key's override, locked (the audit's "old" values; lock order: first).
KEY_OVERRIDES_LOCK = sa.text(
    f"""
    SELECT CASE WHEN expires_at IS NULL OR expires_at > {NOW} THEN slot_limit END AS live_limit, reason,
           CASE WHEN paused_until > {NOW} THEN paused_until END AS live_pause
      FROM keyed_key_overrides WHERE key = :key FOR UPDATE
    """
)

# key_overrides_set_limit: create or replace the key's own limit (its pause, if any, is kept).
KEY_OVERRIDES_SET_LIMIT = sa.text(
    f"""
    INSERT INTO keyed_key_overrides (key, name, slot_limit, expires_at, reason, author, set_at)
    VALUES (:key, :name, :limit,
            CASE WHEN CAST(:until AS timestamptz) IS NOT NULL OR CAST(:seconds AS double precision) IS NOT NULL
                 THEN {_UNTIL} END,
            :reason, :author, {NOW})
    ON CONFLICT (key) DO UPDATE SET slot_limit = excluded.slot_limit, expires_at = excluded.expires_at,
        reason = excluded.reason, author = excluded.author, set_at = excluded.set_at
    RETURNING expires_at
    """
)

# key_overrides_pause: pause the key until a time, only if that extends its pause (no row: a pause at least that
# long is in force already, and nothing changed). Its limit, if any, is kept.
KEY_OVERRIDES_PAUSE = sa.text(
    f"""
    INSERT INTO keyed_key_overrides (key, name, paused_until, pause_reason, pause_author, paused_at)
    VALUES (:key, :name, {_UNTIL}, :reason, :author, {NOW})
    ON CONFLICT (key) DO UPDATE SET paused_until = excluded.paused_until, pause_reason = excluded.pause_reason,
        pause_author = excluded.pause_author, paused_at = excluded.paused_at
     WHERE keyed_key_overrides.paused_until IS NULL OR keyed_key_overrides.paused_until < excluded.paused_until
    RETURNING paused_until
    """
)

# key_overrides_clear_limit / key_overrides_resume: remove one part (no row: there was none).
KEY_OVERRIDES_CLEAR_LIMIT = sa.text(
    """
    UPDATE keyed_key_overrides SET slot_limit = NULL, expires_at = NULL, reason = NULL, author = '', set_at = NULL
     WHERE key = :key AND slot_limit IS NOT NULL
    RETURNING key
    """
)
KEY_OVERRIDES_RESUME = sa.text(
    """
    UPDATE keyed_key_overrides SET paused_until = NULL, pause_reason = NULL, pause_author = '', paused_at = NULL
     WHERE key = :key AND paused_until IS NOT NULL
    RETURNING key
    """
)

# key_overrides_drop_empty: a row that holds neither a limit nor a pause any more goes (same transaction).
KEY_OVERRIDES_DROP_EMPTY = sa.text(
    "DELETE FROM keyed_key_overrides WHERE key = :key AND slot_limit IS NULL AND paused_until IS NULL"
)

# key_overrides_lapsed: one key whose limit expired or whose pause ended (the sweep clears, logs and promotes it),
# locked; SKIP LOCKED: another sweep or a writer holds it.
KEY_OVERRIDES_LAPSED = sa.text(
    f"""
    SELECT key, name, CASE WHEN expires_at <= {NOW} THEN slot_limit END AS lapsed_limit,
           COALESCE(paused_until <= {NOW}, false) AS pause_over
      FROM keyed_key_overrides WHERE expires_at <= {NOW} OR paused_until <= {NOW}
     ORDER BY key LIMIT 1 FOR UPDATE SKIP LOCKED
    """
)

#: The live override of a key, as operators read it (status, explain, the CLI).
_LIVE_COLUMNS = f"""key, name,
           CASE WHEN expires_at IS NULL OR expires_at > {NOW} THEN slot_limit END AS slot_limit,
           CASE WHEN expires_at IS NULL OR expires_at > {NOW} THEN expires_at END AS expires_at,
           CASE WHEN expires_at IS NULL OR expires_at > {NOW} THEN reason END AS reason,
           CASE WHEN expires_at IS NULL OR expires_at > {NOW} THEN author END AS author,
           CASE WHEN paused_until > {NOW} THEN paused_until END AS paused_until,
           CASE WHEN paused_until > {NOW} THEN pause_reason END AS pause_reason,
           CASE WHEN paused_until > {NOW} THEN pause_author END AS pause_author,
           keyed_key_limit(key, {NOW}) AS effective_limit"""
_LIVE = f"(paused_until > {NOW} OR (slot_limit IS NOT NULL AND (expires_at IS NULL OR expires_at > {NOW})))"

# key_overrides_get: the live override of one key (no row: none in force).
KEY_OVERRIDES_GET = sa.text(f"SELECT {_LIVE_COLUMNS} FROM keyed_key_overrides WHERE key = :key AND {_LIVE}")

# key_overrides_live: the live overrides of every key (or of one name's keys), paused first, at most :limit.
KEY_OVERRIDES_LIVE = sa.text(
    f"""
    SELECT {_LIVE_COLUMNS} FROM keyed_key_overrides
     WHERE {_LIVE} AND (CAST(:name AS text) IS NULL OR name = :name)
     ORDER BY paused_until > {NOW} DESC NULLS LAST, key LIMIT :limit
    """
)


@dataclass(frozen=True)
class KeyOverride:
    """The override of one key in force now: its own ``slot_limit`` (None: its name's applies) with reason, author
    and expiry, and its pause (``paused_until``, None: not paused) with its reason and author; ``effective_limit``:
    what a claim of the key sees now (``keyed_key_limit``: 0 while paused or while its name is paused)."""

    key: str
    name: str
    slot_limit: int | None
    expires_at: datetime | None
    reason: str | None
    author: str | None
    paused_until: datetime | None
    pause_reason: str | None
    pause_author: str | None
    effective_limit: int

    @property
    def paused(self) -> bool:
        return self.paused_until is not None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "paused": self.paused}


def _key_override(row: Any) -> KeyOverride:
    return KeyOverride(
        key=row.key,
        name=row.name,
        slot_limit=row.slot_limit,
        expires_at=row.expires_at,
        reason=row.reason,
        author=row.author,
        paused_until=row.paused_until,
        pause_reason=row.pause_reason,
        pause_author=row.pause_author,
        effective_limit=int(row.effective_limit),
    )


def key_override_get(conn: sa.Connection, key: str, *, now: datetime | None = None) -> KeyOverride | None:
    """The override of ``key`` in force now, or None."""
    row = conn.execute(KEY_OVERRIDES_GET, {"key": key, "now": now}).first()
    return None if row is None else _key_override(row)


def key_overrides_live(
    conn: sa.Connection, *, name: str | None = None, limit: int = 1000, now: datetime | None = None
) -> list[KeyOverride]:
    """The key overrides in force now (of ``name``'s keys only, when given): paused keys first, then by key."""
    rows = conn.execute(KEY_OVERRIDES_LIVE, {"name": name, "limit": limit, "now": now})
    return [_key_override(r) for r in rows]


def _check_reason(reason: Any) -> str:
    if not isinstance(reason, str) or not reason.strip():
        raise InvalidConfig("a key override needs a reason")
    return check_audit_text(reason, "the reason")


def _log(
    conn: sa.Connection, key: str, action: str, old: int | None, new: int | None, *, reason: str, author: str,
    expires_at: Any, now: datetime | None,
) -> None:
    conn.execute(
        OVERRIDE_LOG_INSERT,
        {
            "name": key_name(key),
            "key": key,
            "action": action,
            "old_limit": old,
            "new_limit": new,
            "reason": reason,
            "author": author,
            "expires_at": expires_at,
            "now": now,
        },
    )


def set_key_limit(
    conn: sa.Connection,
    key: str,
    limit: int,
    *,
    reason: str,
    author: str = "",
    expires_at: datetime | None = None,
    expires_in: float | None = None,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: datetime | None = None,
) -> list[Promotion]:
    """Give ``key`` a limit of its own (replacing its name's for this key; 0 stops it like a pause without an end)
    until ``expires_at`` or for ``expires_in`` seconds (neither: until cleared). Lowering never preempts; raising
    promotes its waiters in this transaction (returned: the caller dispatches them after commit). Setting the limit
    the key has already, for the same reason, only moves its expiry: no new audit row (a task repeating a vendor's
    header on every call)."""
    key = normalize_key(key)  # a str or a (name, ident) tuple, as a task's keys
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= SLOT_LIMIT_MAX:
        raise InvalidConfig(
            f"{key}: a key limit must be a non-negative integer (0 stops the key), at most {SLOT_LIMIT_MAX},"
            f" got {limit!r}"
        )
    _check_reason(reason)
    check_audit_text(author, "the author")
    expires_at = check_expiry(expires_at)
    if expires_in is not None:
        check_seconds(expires_in, "expires")
    if expires_at is not None and expires_in is not None:
        raise InvalidConfig("give expires_at or expires_in, not both")
    old = conn.execute(KEY_OVERRIDES_LOCK, {"key": key, "now": now}).first()
    params = {
        "key": key, "name": key_name(key), "limit": limit, "reason": reason, "author": author,
        "until": expires_at, "seconds": expires_in, "now": now,
    }
    until = conn.execute(KEY_OVERRIDES_SET_LIMIT, params).scalar_one_or_none()
    conn.execute(slots.SLOTS_TOUCH, {"key": key})  # a claim racing a lowered limit re-checks against it
    if old is None or old.live_limit != limit or old.reason != reason:
        old_limit = None if old is None else old.live_limit
        _log(conn, key, "set", old_limit, limit, reason=reason, author=author, expires_at=until, now=now)
    return promote_key(conn, key, dispatch=dispatch, now=now)


def clear_key_limit(
    conn: sa.Connection,
    key: str,
    *,
    reason: str = "",
    author: str = "",
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: datetime | None = None,
) -> list[Promotion] | None:
    """Remove the key's own limit: its name's applies again at once (its pause, if any, stays). None when it had
    none (nothing changed)."""
    key = normalize_key(key)
    check_audit_text(reason, "the reason")
    check_audit_text(author, "the author")
    old = conn.execute(KEY_OVERRIDES_LOCK, {"key": key, "now": now}).first()
    if conn.execute(KEY_OVERRIDES_CLEAR_LIMIT, {"key": key}).first() is None:
        return None
    conn.execute(KEY_OVERRIDES_DROP_EMPTY, {"key": key})
    old_limit = None if old is None else old.live_limit
    _log(conn, key, "clear", old_limit, None, reason=reason, author=author, expires_at=None, now=now)
    return promote_key(conn, key, dispatch=dispatch, now=now)


def pause_key(
    conn: sa.Connection,
    key: str,
    seconds: float | None = None,
    *,
    until: datetime | None = None,
    reason: str,
    author: str = "",
    now: datetime | None = None,
) -> tuple[datetime, bool]:
    """Pause ``key`` for ``seconds`` (or until ``until``): nothing new of the key starts before then; running
    attempts go on; its waiters keep their places. A pause is only ever extended: when one at least that long is
    in force nothing changes. Returns (the end of the pause in force, whether this call set it)."""
    key = normalize_key(key)
    _check_reason(reason)
    check_audit_text(author, "the author")
    until = check_expiry(until, "until")
    if (seconds is None) == (until is None):
        raise InvalidConfig("pause a key for some seconds or until a time (one of the two)")
    if seconds is not None:
        check_seconds(seconds, "seconds")
    conn.execute(KEY_OVERRIDES_LOCK, {"key": key, "now": now})
    params = {
        "key": key, "name": key_name(key), "reason": reason, "author": author, "until": until, "seconds": seconds,
        "now": now,
    }
    paused_until = conn.execute(KEY_OVERRIDES_PAUSE, params).scalar_one_or_none()
    conn.execute(slots.SLOTS_TOUCH, {"key": key})  # a claim racing the pause commits first or re-checks against it
    if paused_until is None:  # a pause at least that long is in force
        current = conn.execute(KEY_OVERRIDES_LOCK, {"key": key, "now": now}).first()
        return (current.live_pause if current is not None and current.live_pause else until), False  # type: ignore[return-value]
    _log(conn, key, "pause", None, 0, reason=reason, author=author, expires_at=paused_until, now=now)
    return paused_until, True


def resume_key(
    conn: sa.Connection,
    key: str,
    *,
    reason: str = "",
    author: str = "",
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: datetime | None = None,
) -> list[Promotion] | None:
    """End the pause of ``key`` now and promote its waiters (returned). None when it was not paused."""
    key = normalize_key(key)
    check_audit_text(reason, "the reason")
    check_audit_text(author, "the author")
    old = conn.execute(KEY_OVERRIDES_LOCK, {"key": key, "now": now}).first()
    if old is None or old.live_pause is None:
        return None
    conn.execute(KEY_OVERRIDES_RESUME, {"key": key})
    conn.execute(KEY_OVERRIDES_DROP_EMPTY, {"key": key})
    _log(conn, key, "resume", 0, None, reason=reason, author=author, expires_at=None, now=now)
    return promote_key(conn, key, dispatch=dispatch, now=now)


def lapse_one_key_override(
    conn: sa.Connection, *, dispatch: float = DEFAULT_DISPATCH_TIMEOUT, now: datetime | None = None
) -> tuple[bool, list[Promotion]]:
    """The sweep's step (D2): take one key whose limit expired or whose pause ended, clear what lapsed, log it
    (``expire`` / ``resume``, author empty) and promote the key's waiters in the same transaction. (False, []) when
    there is none left."""
    row = conn.execute(KEY_OVERRIDES_LAPSED, {"now": now}).first()
    if row is None:
        return False, []
    if row.lapsed_limit is not None:
        conn.execute(KEY_OVERRIDES_CLEAR_LIMIT, {"key": row.key})
        _log(conn, row.key, "expire", row.lapsed_limit, None, reason="expired", author="", expires_at=None, now=now)
    if row.pause_over:
        conn.execute(KEY_OVERRIDES_RESUME, {"key": row.key})
        _log(conn, row.key, "resume", 0, None, reason="pause ended", author="", expires_at=None, now=now)
    conn.execute(KEY_OVERRIDES_DROP_EMPTY, {"key": row.key})
    return True, promote_key(conn, row.key, dispatch=dispatch, now=now)
