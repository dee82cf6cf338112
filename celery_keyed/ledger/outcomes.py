"""Outcomes: the task's one final outcome, recorded through the books (``books.books_finish`` and
``books.BOOKS_SETTLE``), and what a final outcome sets in motion — a group member leaves its group and the next
number may start (D10, D11). Beneath ``admit``, ``release`` and ``revoke`` (they all finish tasks), above
``promote`` (a group that moves on promotes its new head).

A failing group head meets its group's failure policy here too (docs/groups.md): which attempt outcomes count as
"the head failed" (``HEAD_FAILED``), the dead-letter of a head that asks for a retry under ``skip``
(``final_outcome``), and the hold of its group under ``hold`` (``hold_group``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import books, groups, waiting
from celery_keyed.ledger.attempts import Outcome, Promotion, TaskOutcome, Token
from celery_keyed.ledger.events import events_record
from celery_keyed.ledger.promote import DEFAULT_DISPATCH_TIMEOUT, promote_group

#: The attempt outcomes that count as "the head failed" for its group's failure policy: a final failure (the body
#: raised for good, or its worker was lost and its message does not come back), an explicit dead-letter, and a retry
#: (the body asked for one). Not a failure: success, a lost worker whose message comes back (the same attempt runs
#: again), a revoke, a supersede; a head that expires or is revoked before it starts never ran.
HEAD_FAILED = frozenset({Outcome.FAILED, Outcome.DEAD_LETTERED, Outcome.RETRY})

#: The longest reason a held group keeps (the failure's detail is cut).
_REASON_MAX = 500


def final_outcome(outcome: Outcome, *, grouped: bool, policy: str | None = None) -> TaskOutcome | None:
    """The task's final outcome for an attempt outcome, or None when the task goes on (retry, worker lost).
    ``policy``: the failure policy of its group when the attempt was a failing head (``head_failure_policy``): under
    ``skip`` a head that asks for a retry is dead-lettered at once (its retry, when it arrives, is a duplicate)."""
    if outcome is Outcome.RETRY and grouped and policy == "skip":
        return TaskOutcome.DEAD_LETTERED
    if outcome in (Outcome.RETRY, Outcome.WORKER_LOST):
        return None
    return dead_letter_rule(TaskOutcome(outcome.value), grouped=grouped)


def head_failure_policy(conn: sa.Connection, group_key: str | None, outcome: Outcome) -> str | None:
    """The failure policy of ``group_key`` (``halt``, ``skip``, ``hold``) when ``outcome`` is a failure of its head;
    None when the attempt had no group or did not fail (``HEAD_FAILED``)."""
    if group_key is None or outcome not in HEAD_FAILED:
        return None
    return groups.groups_failure_policy(conn, group_key)


def hold_group(
    conn: sa.Connection, group_key: str, token: Token, outcome: Outcome, *, detail: str, now: datetime | None
) -> bool:
    """Hold ``group_key`` for an operator after its head ``token`` failed with ``outcome`` (locks the group row,
    last in the lock order), when its policy is ``hold`` and it is not held yet; recorded as a ``group_held`` event.
    True: held now."""
    groups.groups_lock(conn, group_key)
    what = "asked for a retry" if outcome is Outcome.RETRY else "failed"
    reason = f"its head {token.task_id} (attempt {token.attempt}) {what}" + (f": {detail}" if detail else "")
    reason = reason if len(reason) <= _REASON_MAX else reason[: _REASON_MAX - 1] + "…"
    if not groups.groups_hold(conn, group_key, token.task_id, reason=reason, now=now):
        return False
    events_record(conn, "group_held", key=group_key, task_id=token.task_id, detail=reason, now=now)
    return True


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
    if outcome is TaskOutcome.FAILED and groups.groups_failure_policy(conn, row.group_key) == "hold":
        token = Token(task_id, int(locked.finished_attempt or 0))
        hold_group(conn, row.group_key, token, Outcome.FAILED, detail=detail, now=now)
    groups.groups_lock(conn, row.group_key)
    groups.members_finish(conn, task_id)
    unblock_head(conn, row.group_key)
    return True, promote_group(conn, row.group_key, dispatch=dispatch, now=now)


def unblock_head(conn: sa.Connection, group_key: str) -> None:
    head, _ = groups.groups_head(conn, group_key)
    if head is not None:
        waiting.waiting_unblock(conn, group_key, head)
