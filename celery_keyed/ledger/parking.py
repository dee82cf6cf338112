"""Parking an arrival that cannot start now (the last step of ``admit.admit``): a cost no key of its name can hold
is refused; a debounced arrival joins or replaces its burst; otherwise it takes a place in the waiting room of its
line (``max_waiting``, with the name's overflow policy: refuse the arrival, or supersede the oldest parked attempt or
the one with its supersede key) and its waiting row is inserted. Runs in the admission's transaction, with the key's
slot and head rows locked.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import keys, names, waiting
from celery_keyed.ledger.attempts import Admission, Arrival, Promotion, TaskOutcome, Token, Verdict
from celery_keyed.ledger.keyspec import key_name
from celery_keyed.ledger.newest_wins import Cancels, withdraw_cancels
from celery_keyed.ledger.outcomes import finish_never_ran


def park(
    conn: sa.Connection,
    arrival: Arrival,
    rooms: dict[str, int | None],
    *,
    name: str | None,
    group_seq: int | None,
    is_head: bool,
    promoted: list[Promotion],
    cancels: Cancels,
    now: datetime | None,
) -> Admission:
    """Park the arrival durably (PARKED), or record why it cannot wait (REJECTED: a cost no key can hold, a full
    waiting room; a debounce may decide it SUPERSEDED)."""
    token = arrival.token
    too_heavy = _too_heavy(conn, arrival) if arrival.cost > 1 and not arrival.exclusive else None
    if too_heavy is not None:
        withdraw_cancels(conn, arrival, cancels)
        finish_never_ran(conn, token, TaskOutcome.REJECTED, detail=too_heavy, now=now)
        return Admission(Verdict.REJECTED, detail=too_heavy, promotions=tuple(promoted))
    # Park in the line of the first key (in the task's order) without room for it; an attempt that waits for
    # its group or its not-before time stands in its first key's line.
    line = next((k for k in arrival.keys if rooms[k] is None), arrival.key)
    replaced: list[str] = []
    debounce_cap: Any = None
    if arrival.debounce is not None:  # it stands in its first key's line, where its burst is found
        line = arrival.key
        debounced = _debounce(conn, arrival, promoted, now=now)
        if isinstance(debounced, Admission):
            return debounced
        replaced, debounce_cap = debounced
    superseded: list[str] | None = []
    if line is not None and not replaced:  # a replacing arrival takes the replaced one's place in the room
        superseded = _make_place(conn, arrival, line, now=now)
        if superseded is None:
            withdraw_cancels(conn, arrival, cancels)
            detail = f"waiting room of {line} is full"
            finish_never_ran(conn, token, TaskOutcome.REJECTED, detail=detail, now=now)
            return Admission(Verdict.REJECTED, detail=detail, promotions=tuple(promoted))
    waiting.waiting_insert(
        conn, arrival, name=name, group_seq=group_seq, group_blocked=not is_head, line=line,
        debounce_cap=debounce_cap, now=now,
    )
    if cancels:  # newest wins: the slot the cancelled attempt frees goes to the newest
        conn.execute(waiting.WAITING_TO_HEAD, {"task_id": arrival.task_id, "attempt": arrival.attempt})
    return Admission(
        Verdict.PARKED,
        superseded=(*replaced, *(superseded or ())),
        promotions=tuple(promoted),
        debounced=arrival.debounce is not None,
        cancels=cancels,
    )


def _debounce(
    conn: sa.Connection, arrival: Arrival, promoted: list[Promotion], *, now: datetime | None
) -> tuple[list[str], Any] | Admission:
    """Debounce per key, with the key's slot and head rows locked (every arrival of the key takes
    them first, so the arrivals of one burst are decided one after the other and one of them survives). A burst is
    *open* while its waiting row's due time (``not_before``) is in the future; a due row waits for a slot like any
    other and absorbs no arrival (a new burst begins).

    - Keep last: the open burst's row is removed and recorded ``superseded`` (replaced by this arrival), and this
      arrival parks in its place, due after a new quiet period but never after the replaced burst's cap (its first
      arrival + ``debounce_max``). Returns (the replaced task ids, that cap) — ([], None) when no burst was open.
    - Keep first: the open burst's row keeps its arguments and its due time moves to the end of a new quiet period
      (never past its cap: the quiet period counts from the latest arrival, whichever arguments run), and this
      arrival is recorded ``superseded`` at once: returns its Admission (SUPERSEDED). ([], None): no burst was open,
      this arrival opens one."""
    assert arrival.key is not None
    params = {"key": arrival.key, "debounce_key": arrival.debounce_key, "debounce": arrival.debounce, "now": now}
    if arrival.debounce_keep == "first":
        kept = conn.execute(waiting.WAITING_DEBOUNCE_EXTEND, params).first()
        if kept is None:
            return [], None
        detail = f"debounced: {kept.task_id} runs instead (keep first), due {kept.not_before.isoformat()}"
        finish_never_ran(conn, arrival.token, TaskOutcome.SUPERSEDED, detail=detail, now=now)
        return Admission(Verdict.SUPERSEDED, detail=detail, promotions=tuple(promoted), debounced=True)
    rows = conn.execute(waiting.WAITING_DEBOUNCE_REPLACE, params).all()
    for r in rows:
        finish_never_ran(
            conn, Token(r.task_id, r.attempt), TaskOutcome.SUPERSEDED,
            detail=f"debounced: replaced by {arrival.task_id}", message=r.message, now=now,
        )
    if len(rows) > 1:  # one place in the room goes to this arrival, the others are given back
        keys.keys_remove_waiting(conn, arrival.key, len(rows) - 1, now=now)
    return [r.task_id for r in rows], min((r.debounce_cap for r in rows), default=None)


def _too_heavy(conn: sa.Connection, arrival: Arrival) -> str | None:
    """Why an attempt of this cost can never start (it needs more slots than a key of its name can have), or
    None. Bad input gets a recorded rejection instead of waiting for ever."""
    wanted = sorted({key_name(k) for k in arrival.keys})
    # A limit computed from the call is the limit of its key (the first): this arrival's, else the one the key's
    # latest call stored, replaces its name's configured one here, unless another key of the attempt has that name
    # too (which the call's limit does not cover).
    call_name = key_name(arrival.key) if arrival.key is not None else None
    if call_name is not None and any(key_name(k) == call_name for k in arrival.extra_keys):
        call_name = None
    params = {"names": wanted, "call_name": call_name, "call_key": arrival.key, "call_limit": arrival.call_limit}
    for row in conn.execute(names.NAMES_LARGEST_SHARE, params):
        if arrival.cost > row.share:
            return (
                f"cost {arrival.cost} exceeds the {row.share} slots (or rate tokens, or starts in a rate window)"
                f" a key of {row.name} can have"
            )
    return None


def _make_place(conn: sa.Connection, arrival: Arrival, line: str, *, now: datetime | None) -> list[str] | None:
    """Count the arrival in its key's waiting room (max_waiting). Under the overflow policy 'supersede' a
    newer arrival first replaces the parked attempt with the same supersede key, and when the room is full,
    the oldest parked attempt of the lowest priority. Returns the replaced task ids, or None when there is no
    place. (The policy is only read when it can matter.) ``line``: the key whose waiting room it enters."""
    name = key_name(line)
    replaced: list[str] = []
    policy: str | None = None
    if arrival.supersede_key:
        policy = _overflow_policy(conn, name)
        if policy == "supersede" or arrival.on_newer is not None:  # newest wins replaces the parked ones too
            rows = conn.execute(
                waiting.WAITING_DELETE_SUPERSEDED, {"key": line, "supersede_key": arrival.supersede_key}
            ).all()
            replaced += _supersede(conn, arrival, line, rows, now=now)
    if keys.keys_add_waiting(conn, line):
        return replaced
    if (policy or _overflow_policy(conn, name)) != "supersede":
        return None
    rows = conn.execute(waiting.WAITING_DELETE_OLDEST, {"key": line}).all()
    if not rows:
        return None
    replaced += _supersede(conn, arrival, line, rows, now=now)
    keys.keys_add_waiting(conn, line, force=True)
    return replaced


def _overflow_policy(conn: sa.Connection, name: str) -> str | None:
    return conn.execute(names.NAMES_OVERFLOW, {"name": name}).scalar_one_or_none()


def _supersede(
    conn: sa.Connection, arrival: Arrival, line: str, rows: Sequence[Any], *, now: datetime | None
) -> list[str]:
    if rows:
        keys.keys_remove_waiting(conn, line, len(rows), now=now)
    for r in rows:
        finish_never_ran(
            conn, Token(r.task_id, r.attempt), TaskOutcome.SUPERSEDED, detail=f"replaced by {arrival.task_id}",
            message=r.message, now=now,
        )
    return [r.task_id for r in rows]
