"""Group failure policies: the operator's side of a held group (docs/groups.md).

A group whose name's ``group_failure`` is ``hold`` is held when its head fails (``outcomes.hold_group``, in the
release of the head): nothing of it starts until an operator either resumes it (``resume_group``: the group goes on
as if the failure had not held it — the head's retry runs, or the next number when the head ended for good) or
skips its head (``skip_group_head``: the failed head, when it has not ended yet, is dead-lettered — its parked retry
leaves the waiting room, a retry still in transit is dropped when it arrives — and the next number starts). Both are
one transaction, guarded by the hold they end (a second call, or a call racing another operator, changes nothing),
recorded as ledger events, and return what they promoted (the caller publishes it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import books, claims, groups, keys, waiting
from celery_keyed.ledger.attempts import Promotion, TaskOutcome, Token
from celery_keyed.ledger.errors import WrongState
from celery_keyed.ledger.events import events_record
from celery_keyed.ledger.keyspec import key_name
from celery_keyed.ledger.outcomes import finish_never_ran, unblock_head
from celery_keyed.ledger.promote import DEFAULT_DISPATCH_TIMEOUT, give_back_reserved, promote_freed, promote_group


@dataclass(frozen=True)
class GroupHold:
    """A held group: since when, the head whose failure held it, why, and how many members it still has."""

    group_key: str
    held_since: datetime
    task_id: str
    reason: str
    members: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "group_key": self.group_key, "held_since": self.held_since.isoformat(), "task_id": self.task_id,
            "reason": self.reason, "members": self.members,
        }


@dataclass
class GroupAction:
    """What an operator's resume or skip did: the hold it ended, whether the failed head was dead-lettered by it
    (``skipped``; False when it had ended already, or on a resume), and the promotions (to publish)."""

    group_key: str
    task_id: str
    skipped: bool = False
    promotions: list[Promotion] = field(default_factory=list)


def held_groups(conn: sa.Connection, *, limit: int = 100) -> list[GroupHold]:
    """The held groups, oldest hold first."""
    return [
        GroupHold(r.group_key, r.held_since, r.held_task_id, r.held_reason, int(r.members))
        for r in conn.execute(groups.GROUPS_HELD, {"limit": limit})
    ]


# groups_held_by_name: how many groups of each group name are held now (the partial index of held groups).
GROUPS_HELD_BY_NAME = sa.text(
    """
    SELECT split_part(group_key, ':', 1) AS name, count(*) AS held
      FROM keyed_groups WHERE held_since IS NOT NULL GROUP BY 1 ORDER BY 1
    """
)


def held_groups_by_name(conn: sa.Connection) -> dict[str, int]:
    """How many groups of each group name are held for an operator now (names with none are left out)."""
    return {r.name: int(r.held) for r in conn.execute(GROUPS_HELD_BY_NAME)}


def group_hold(conn: sa.Connection, group_key: str) -> GroupHold | None:
    """The hold of ``group_key``, or None when it is not held."""
    row = groups.groups_hold_get(conn, group_key)
    return None if row is None else GroupHold(row.group_key, row.held_since, row.held_task_id, row.held_reason)


def resume_group(
    conn: sa.Connection,
    group_key: str,
    *,
    reason: str = "",
    author: str = "",
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: datetime | None = None,
) -> GroupAction | None:
    """End the hold of ``group_key``: its head (the failed task's retry, or the next number) may start. None when the
    group is not held (nothing changed)."""
    ended = conn.execute(groups.GROUPS_RESUME, {"group_key": group_key, "task_id": None}).first()
    if ended is None:
        return None
    events_record(conn, "group_resumed", key=group_key, task_id=ended.held_task_id,
                  detail=_who(author, reason), now=now)
    unblock_head(conn, group_key)
    return GroupAction(group_key, ended.held_task_id,
                       promotions=promote_group(conn, group_key, dispatch=dispatch, now=now))


def skip_group_head(
    conn: sa.Connection,
    group_key: str,
    *,
    reason: str = "",
    author: str = "",
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: datetime | None = None,
) -> GroupAction | None:
    """Dead-letter the failed head of held ``group_key`` (when it has not ended yet) and end the hold: the next number
    may start. None when the group is not held. Raises :class:`WrongState` (and changes nothing) when the group was
    resumed or skipped meanwhile."""
    hold = groups.groups_hold_get(conn, group_key)
    if hold is None:
        return None
    task_id = hold.held_task_id
    who = _who(author, reason)
    promotions: list[Promotion] = []
    # lock order: the task's row first, then its slots and keys, the group last (as a revoke)
    locked = conn.execute(books.BOOKS_LOCK_TASK, {"task_id": task_id}).first()
    skipped = locked is not None and locked.outcome is None
    if skipped:
        assert locked is not None
        if conn.execute(claims.CLAIMS_OF_TASK, {"task_id": task_id}).first() is not None:
            raise WrongState(f"group {group_key}: its head {task_id} holds a claim (resumed meanwhile); not skipped")
        rows = conn.execute(waiting.WAITING_DELETE_TASK, {"task_id": task_id}).all()
        freed = [fr for r in rows for fr in give_back_reserved(conn, r, now=now)]
        for key in sorted({r.key for r in rows if r.key is not None}):
            keys.keys_lock(conn, key, key_name(key), now=now)
            keys.keys_remove_waiting(conn, key, now=now)
        promotions += promote_freed(conn, freed, dispatch=dispatch, now=now)
        attempt = rows[0].attempt if rows else int(locked.finished_attempt) + 1
        promotions += finish_never_ran(
            conn, Token(task_id, attempt), TaskOutcome.DEAD_LETTERED, detail=f"head of a held group skipped, {who}",
            dispatch=dispatch, message=rows[0].message if rows else None, now=now,
        )
    if conn.execute(groups.GROUPS_RESUME, {"group_key": group_key, "task_id": task_id}).first() is None:
        raise WrongState(f"group {group_key} was resumed or skipped meanwhile; nothing changed")
    events_record(conn, "group_head_skipped", key=group_key, task_id=task_id,
                  detail=who if skipped else f"{who} (its head had ended already)", now=now)
    unblock_head(conn, group_key)
    promotions += promote_group(conn, group_key, dispatch=dispatch, now=now)
    return GroupAction(group_key, task_id, skipped=skipped, promotions=promotions)


def _who(author: str, reason: str) -> str:
    return f"by {author or 'an operator'}" + (f": {reason}" if reason else "")
