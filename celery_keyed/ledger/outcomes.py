"""Outcomes: the task's one final outcome, recorded through the books (``books.books_finish`` and
``books.BOOKS_SETTLE``), and what a final outcome sets in motion — a group member leaves its group and the next
number may start (D10, D11). Beneath ``admit``, ``release`` and ``revoke`` (they all finish tasks), above
``promote`` (a group that moves on promotes its new head).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import books, groups, waiting
from celery_keyed.ledger.attempts import Outcome, Promotion, TaskOutcome, Token
from celery_keyed.ledger.promote import DEFAULT_DISPATCH_TIMEOUT, promote_group


def final_outcome(outcome: Outcome, *, grouped: bool) -> TaskOutcome | None:
    """The task's final outcome for an attempt outcome, or None when the task goes on (retry, worker lost)."""
    if outcome in (Outcome.RETRY, Outcome.WORKER_LOST):
        return None
    return dead_letter_rule(TaskOutcome(outcome.value), grouped=grouped)


def dead_letter_rule(final: TaskOutcome, *, grouped: bool) -> TaskOutcome:
    """The dead-letter rule (D11), written here only: a group member's final failure is a dead-letter, and its group
    moves on. Every path that records a final outcome of a task that may be grouped passes through it (the
    release's ``final_outcome``, ``settle``); the server-side release paths take their finals from it."""
    return TaskOutcome.DEAD_LETTERED if final is TaskOutcome.FAILED and grouped else final


def finish_never_ran(
    conn: sa.Connection,
    token: Token,
    outcome: TaskOutcome,
    *,
    detail: str,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    message: Any = None,
    now: datetime | None = None,
) -> list[Promotion]:
    """Record the final outcome of a task that will not run; if it was a group member, the group moves on.
    ``message``: its stored message when it was parked (kept until its result is stored: docs/canvas.md)."""
    books.books_finish(conn, token.task_id, outcome, attempt=token.attempt, detail=detail, message=message, now=now)
    member = groups.members_get(conn, token.task_id)
    if member is None:
        return []
    groups.groups_lock(conn, member.group_key)
    groups.members_finish(conn, token.task_id)
    unblock_head(conn, member.group_key)
    return promote_group(conn, member.group_key, dispatch=dispatch, now=now)


def settle(
    conn: sa.Connection,
    task_id: str,
    outcome: TaskOutcome,
    *,
    detail: str,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: datetime | None = None,
) -> tuple[bool, list[Promotion]]:
    """Record the final ``outcome`` of a task that has no attempt in the ledger any more (its result says its
    body ended, but its release never committed: D15); its group moves on. (False, []) when the task is not
    open and idle any more (an attempt arrived meanwhile, or its outcome is recorded)."""
    # lock order: the task's row first, then look (D1); its group is read under the lock
    locked = conn.execute(books.BOOKS_LOCK_TASK, {"task_id": task_id}).first()
    if locked is None:
        return False, []
    final = dead_letter_rule(outcome, grouped=locked.group_key is not None)
    params = {"task_id": task_id, "outcome": final, "detail": detail, "now": now}
    row = conn.execute(books.BOOKS_SETTLE, params).first()
    if row is None:
        return False, []
    if row.group_key is None:
        return True, []
    groups.groups_lock(conn, row.group_key)
    groups.members_finish(conn, task_id)
    unblock_head(conn, row.group_key)
    return True, promote_group(conn, row.group_key, dispatch=dispatch, now=now)


def unblock_head(conn: sa.Connection, group_key: str) -> None:
    head, _ = groups.groups_head(conn, group_key)
    if head is not None:
        waiting.waiting_unblock(conn, group_key, head)
