"""Limits computed from the call: the limit of a key that its latest arrival computed from the call's arguments
(a task's ``concurrency_limit``), stored with the key (table ``keyed_call_limits``).

``keyed_key_limit`` reads it after the operators' overrides and before the name's configured limit: a key's own
pause or limit (``celery keyed pause-key`` / ``set-key-limit``) wins, then a live override of its name (a paused
name pauses every key), then the call's limit, then ``keyed_concurrency_limits``. When two calls of one key
disagree, the key's limit is the one its latest arrival carried (the last the ledger received that had not expired
and was not an attempt it knew; in a batch, the batch's last of the key): a raise gives its room to the key's line
at once, before the arrival is decided (D2); a lowered limit lets the attempts running finish and starts nothing
while the key is at or above it, as a lowered name limit does.

Admission writes it first (``store_first``, called by ``batches.Batches`` before a batch or an arrival is decided):
one transaction stores every limit of the batch, key by key in key order, and promotes the waiters of a key whose
limit it changed; the arrivals are then decided by the usual paths, the fast ones included, which read the key's
limit in Postgres as any claim does. An arrival that expired already, or an attempt the ledger knows (a redelivery),
stores nothing. No statement of a claim or a release locks these rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger.attempts import Promotion
from celery_keyed.ledger.bounds import SLOT_LIMIT_MAX, check_int
from celery_keyed.ledger.clock import NOW
from celery_keyed.ledger.promote import promote_key

# call_limits_store: the limits a batch of arrivals computed, one statement: per key, the batch's last arrival that
# counts (not expired already, not an attempt the ledger knows: a redelivery decides nothing new). A value that did
# not change is not written again (no WAL on the hot path of a steady key) except to refresh seen_at once an hour,
# which keeps reconcile from pruning the row of a key still in use (ON CONFLICT ... DO UPDATE locks the row either
# way, so a prune racing the arrival waits for it and re-checks seen_at). Rows are locked in key order (the insert
# reads them sorted). Answers the keys it wrote (a new value, the key's first, or a refresh).
CALL_LIMITS_STORE = sa.text(
    f"""
    WITH arr AS (
        SELECT * FROM unnest(CAST(:keys AS text[]), CAST(:limits AS integer[]), CAST(:task_ids AS text[]),
                             CAST(:attempts AS integer[]), CAST(:deadlines AS timestamptz[]))
                 WITH ORDINALITY AS a(key, slot_limit, task_id, attempt, deadline, ord)
    ), counted AS (
        SELECT DISTINCT ON (a.key) a.key, a.slot_limit, a.task_id FROM arr a
         WHERE (a.deadline IS NULL OR a.deadline > {NOW})
           AND NOT EXISTS (SELECT 1 FROM keyed_claims c WHERE c.task_id = a.task_id AND c.attempt = a.attempt)
           AND NOT EXISTS (SELECT 1 FROM keyed_waiting w WHERE w.task_id = a.task_id AND w.attempt = a.attempt)
           AND NOT EXISTS (SELECT 1 FROM keyed_tasks t WHERE t.task_id = a.task_id
                              AND (t.outcome IS NOT NULL OR t.finished_attempt >= a.attempt))
         ORDER BY a.key, a.ord DESC
    )
    INSERT INTO keyed_call_limits AS l (key, name, slot_limit, set_at, task_id, seen_at)
    SELECT c.key, split_part(c.key, ':', 1), c.slot_limit, {NOW}, c.task_id, {NOW} FROM counted c ORDER BY c.key
    ON CONFLICT (key) DO UPDATE
       SET slot_limit = excluded.slot_limit,
           set_at = CASE WHEN l.slot_limit = excluded.slot_limit THEN l.set_at ELSE excluded.set_at END,
           task_id = CASE WHEN l.slot_limit = excluded.slot_limit THEN l.task_id ELSE excluded.task_id END,
           seen_at = excluded.seen_at
     WHERE l.slot_limit <> excluded.slot_limit OR l.seen_at < excluded.seen_at - interval '1 hour'
    RETURNING l.key
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


def store_first(
    conn: sa.Connection, arrivals: Sequence[Any], *, dispatch: float, now: datetime | None = None
) -> dict[int, list[Promotion]]:
    """Before a batch is decided: store the limit each arrival carries (``call_limit``; per key the batch's last
    arrival that counts wins), in one statement, and give the room a new limit makes to the key's line (D2), key by
    key in key order, in the same transaction. The promotions, by the input position of the last arrival of their
    key (its answer carries them to the caller, which starts them)."""
    carrying = [(i, a) for i, a in enumerate(arrivals) if a.call_limit is not None and a.key is not None]
    if not carrying:
        return {}
    params = {
        "keys": [a.key for _, a in carrying],
        "limits": [a.call_limit for _, a in carrying],
        "task_ids": [a.task_id for _, a in carrying],
        "attempts": [a.attempt for _, a in carrying],
        "deadlines": [a.deadline for _, a in carrying],
        "now": now,
    }
    wrote = set(conn.execute(CALL_LIMITS_STORE, params).scalars())
    last = {a.key: i for i, a in carrying}
    out: dict[int, list[Promotion]] = {}
    for key in sorted(wrote):
        promoted = promote_key(conn, key, dispatch=dispatch, now=now)
        if promoted:
            out.setdefault(last[key], []).extend(promoted)
    return out


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
