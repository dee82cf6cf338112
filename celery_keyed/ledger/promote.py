"""Promotion: give free slots to the next parked attempts (D2, D4, D5), and give slots back.

``promote_key`` / ``promote_group`` / ``promote_multi`` / ``promote_freed`` run in every transaction that creates
room or eligibility (a release, an override, a reclaimed lease, a dead-lettered head, the sweep). Each runs inside
the caller's transaction and keeps the lock order of the ledger (task row → slot rows by (key, shard) → key head
row → group rows); a step that would need a lock out of that order uses SKIP LOCKED and leaves the work to the lock
holder or the sweep (within one sweep interval, D2). A promoted attempt becomes a claim with a fresh nonce (D5), or,
for a releaser that runs it itself, a running claim of that releaser (``LocalHandoff``, D4).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import claims, groups, keys, names, slots, waiting
from celery_keyed.ledger.attempts import Promotion, Token
from celery_keyed.ledger.bounds import tokens_of
from celery_keyed.ledger.clock import clock_is_past
from celery_keyed.ledger.keyspec import key_name


@dataclass(frozen=True)
class LocalHandoff:
    """A releaser that will run promoted attempts itself (D4): a promotion of a task it has (``tasks``) from a
    queue it consumes (``queues``) is bound to it in the promotion's own transaction — a running claim of
    ``holder`` — so it starts without a bind round trip. The claim keeps the stored message, so a run that is
    lost goes back in line."""

    holder: str
    lease: float
    queues: frozenset[str]
    tasks: frozenset[str]

    def takes(self, cand: Any) -> bool:
        message = cand.message if isinstance(cand.message, dict) else {}
        return cand.queue in self.queues and message.get("task") in self.tasks


#: Seconds a promoted attempt may wait to be bound by its receiver before the reaper voids it (D5).
DEFAULT_DISPATCH_TIMEOUT = 30.0


def give_back(conn: sa.Connection, holding: claims.Holding, *, now: datetime | None = None) -> list[tuple[str, int]]:
    """Give back every slot of a deleted claim, in lock order; the (key, shard) rows that now have room, once
    per free slot."""
    return [
        (key, shard)
        for key, shard in holding.slots()
        for _ in range(slots.slots_give_back(conn, key, shard, cost=holding.cost, now=now))
    ]


def give_back_to_lines(
    conn: sa.Connection, holding: claims.Holding, lines: set[str], *, now: datetime | None = None
) -> list[tuple[str, int]]:
    """Give back every slot of a deleted claim whose removal also puts attempts back in the lines of ``lines``
    (a lost run's stored row restored, its shadow made live): new eligibility on those keys (D2). For a key of
    ``lines`` every shard row is locked (with the claim's own rows, all in (key, shard) order, before any head
    row) and every free slot of the key is listed, not only the ones given back: room on another shard (a
    shard the claim's own is not, e.g. after the shard count or the limit changed, D12) now belongs to the
    attempt back in line. Other keys as ``give_back``: the rows with room, once per free slot."""
    held = holding.slots()
    freed: list[tuple[str, int]] = []
    for key in sorted({k for k, _ in held} | lines):
        own = [(k, sh) for k, sh in held if k == key]
        if key not in lines:
            freed += [
                (k, sh) for k, sh in own for _ in range(slots.slots_give_back(conn, k, sh, cost=holding.cost, now=now))
            ]
            continue
        slots.slots_lock_all(conn, key, key_name(key), now=now)  # every shard row, in shard order
        for k, sh in own:
            slots.slots_give_back(conn, k, sh, cost=holding.cost, now=now)
        uses = slots.slots_lock_all(conn, key, key_name(key), now=now)  # held already: the counts after it
        freed += [(key, u.shard) for u in uses for _ in range(max(0, u.share - u.used))]
    return freed


def give_back_reserved(conn: sa.Connection, row: Any, *, now: datetime | None = None) -> list[tuple[str, int]]:
    """Give back the slots a deleted (or lapsed) waiting row had reserved; the (key, shard) rows with room."""
    if not getattr(row, "reserved_keys", None):
        return []
    pairs = sorted(zip(row.reserved_keys, row.reserved_shards, strict=True))
    return [
        (k, sh) for k, sh in pairs for _ in range(slots.slots_give_back(conn, k, sh, cost=int(row.cost or 1), now=now))
    ]


def promote_freed(
    conn: sa.Connection,
    freed: list[tuple[str, int]],
    *,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: datetime | None = None,
) -> list[Promotion]:
    """Give slots given back outside a release to the next waiters of their keys (head rows locked in order)."""
    for key in sorted({k for k, _ in freed}):
        keys.keys_lock(conn, key, key_name(key), now=now)
    return promote_each_key(conn, freed, dispatch=dispatch, now=now)


def promote_each_key(
    conn: sa.Connection,
    freed: list[tuple[str, int]],
    *,
    dispatch: float,
    local: LocalHandoff | None = None,
    now: datetime | None = None,
) -> list[Promotion]:
    """Promote into free slots listed as (key, shard), one entry per free slot, key by key in lock order (the
    caller holds the rows). A slot left free earlier (a line that was not due yet) is filled too: a release
    fills its shard, not just the slot it gave back."""
    promotions: list[Promotion] = []
    for key in sorted({k for k, _ in freed}):
        shards = [sh for k, sh in freed if k == key]
        promotions += promote_waiters(conn, key, shards, dispatch=dispatch, local=local, now=now)
        if promotions and local is not None:
            local = None  # a releaser runs at most one promotion itself; the others are dispatched
    return promotions


def promote_key(
    conn: sa.Connection, key: str, *, dispatch: float = DEFAULT_DISPATCH_TIMEOUT, now: datetime | None = None
) -> list[Promotion]:
    """Give every free slot of ``key`` to its next promotable waiters (after an override, a limit raise, a
    reclaimed lease, a not-before time passing). Locks the key's shard rows, then its head row."""
    name = key_name(key)
    uses = slots.slots_lock_all(conn, key, name, now=now)
    free = [u.shard for u in uses for _ in range(max(0, u.share - u.used))]
    if not free:
        return []
    keys.keys_lock(conn, key, name, now=now)
    return promote_waiters(conn, key, free, dispatch=dispatch, now=now)


def promote_name(
    conn: sa.Connection, name: str, *, dispatch: float = DEFAULT_DISPATCH_TIMEOUT, now: datetime | None = None
) -> list[Promotion]:
    """Promote waiters of every key of ``name`` that has room now (D2: run wherever room may appear)."""
    promotions: list[Promotion] = []
    for key in conn.execute(keys.KEYS_OF_NAME_WAITING, {"name": name}).scalars().all():
        promotions += promote_key(conn, key, dispatch=dispatch, now=now)
    return promotions


def promote_waiters(
    conn: sa.Connection,
    key: str,
    free_shards: list[int],
    *,
    dispatch: float,
    local: LocalHandoff | None = None,
    now: datetime | None = None,
) -> list[Promotion]:
    """Promote waiters of ``key`` into ``free_shards`` (rows the caller holds locked; at most one promotion per
    entry), in order. The caller holds the key's head row too.

    A fair name's line is read again after each promotion: the next free slot goes to the fair key with the lowest
    load (slots held / weight) as this promotion left it (waiting.WAITING_NEXT_FAIR).

    FIFO per key: when the head of the line needs more slots than are free (a weight), nobody behind it passes:
    the free slots stay reserved for it. An attempt with several keys takes its other keys without waiting (out
    of lock order) where no one stands before it in their lines; when one has no room it moves to that key's
    line, keeping its arrival number, and holds the slots of the keys listed before that one meanwhile
    (docs/ledger.md: the waiting-order policy). A busy row leaves the work to its holder or the sweep."""
    promoted: list[Promotion] = []
    shards = list(dict.fromkeys(free_shards))
    budget = len(free_shards)
    line = conn.execute(waiting.WAITING_CLEAR_DUE_FOR_KEY, {"key": key, "name": key_name(key), "now": now}).one()
    while budget > 0:
        candidates = waiting.waiting_next_for_key(conn, key, limit=budget + 3, fair=line.fair, now=now)
        if not candidates:
            break
        progressed = False
        for cand in candidates:
            if budget <= 0:
                break
            if cand.group_key is not None:
                # Its group must be free and it must be the head; the group row is later in the lock order,
                # so never wait for it: a busy group promotes its own head when it frees.
                if not groups.groups_try_lock(conn, cand.group_key):
                    continue
                head, busy = groups.groups_head(conn, cand.group_key)
                if busy or head != cand.group_seq:
                    continue
            holding = _take_for(conn, cand, key, shards, rated=line.rated, now=now)
            if holding is _MOVED:
                progressed = True  # it left this line for the line of a key it lacks: the next one may start
                continue
            if holding is None:
                return promoted  # the head of the line waits for room; the room is reserved for it
            assert isinstance(holding, claims.Holding)
            promoted.append(
                _promote_row(
                    conn, cand, key=holding.key, shard=holding.shard, holding=holding, dispatch=dispatch, local=local,
                    now=now,
                )
            )
            keys.keys_remove_waiting(conn, cand.key, now=now)
            if promoted[-1].nonce is None:
                local = None  # the releaser runs one promotion itself; the others are dispatched (D4/D5)
            budget -= 1
            progressed = True
            if line.fair:
                break  # weighted fair sharing: the next slot goes by the loads this promotion changed (read again)
        if not progressed:
            break
    return promoted


#: ``_take_for``'s answer when the attempt moved to the line of a key it lacks.
_MOVED: Any = object()


def _take_for(conn: sa.Connection, cand: Any, key: str, shards: list[int], *, rated: bool, now: datetime | None) -> Any:
    """Take every slot (and token) a locked waiting row needs, being promoted through the line of ``key`` (one
    of ``shards``, which the caller holds locked), all or none: a Holding; None when it cannot start and stays
    at the head of this line (an empty token bucket also gives it a not-before time); ``_MOVED`` when it moved
    to the line of another key it lacks.

    Its other keys are taken without waiting and only where no one stands before it in their lines. When one
    of them has no room, the attempt moves to that key's line and keeps (reserves) the slots of the keys listed
    before it; those after are given back. Reserving only in the task's order means two attempts listing their
    keys in one order can never hold what the other needs; other orders are broken by the reservation timeout."""
    cost = int(cand.cost or 1)
    savepoint = conn.begin_nested() if (rated or cand.keys) else None

    def give_up(result: Any = None) -> Any:
        if savepoint is not None:
            savepoint.rollback()
        return result

    name = key_name(key)
    shard = next((sh for sh in shards if slots.slots_take(conn, key, name, sh, cost=cost, now=now)), None)
    if shard is None:
        return give_up()
    got = dict(zip(cand.reserved_keys or (), cand.reserved_shards or (), strict=True))
    got[key] = shard
    missing = _take_others_nowait(conn, cand, got, cost=cost, now=now)
    if missing is None:
        lacking = _take_tokens(conn, cand, key, rated=rated, now=now)
        if lacking is None:
            if savepoint is not None:
                savepoint.commit()
            return _holding(cand, got) if cand.keys else claims.Holding(key, shard, cost=cost, fair_key=cand.fair_key)
        give_up()
        if lacking is not _BUSY:  # wait for the tokens: out of the line until then (D2: the sweep promotes)
            conn.execute(
                waiting.WAITING_NOT_BEFORE,
                {"task_id": cand.task_id, "attempt": cand.attempt, "not_before": lacking},
            )
        return None
    # Cannot start: keep the slots of keys listed before the missing one, give back the rest taken now.
    if conn.execute(keys.KEYS_LOCK_NOWAIT, {"key": missing}).first() is None:
        return give_up()  # the missing key's head row is busy (or not there yet): the sweep moves or starts it
    _move_to_line(conn, cand, key, missing, got, cost=cost, now=now)
    if savepoint is not None:
        savepoint.commit()
    return _MOVED


def _take_others_nowait(
    conn: sa.Connection, cand: Any, got: dict[str, int], *, cost: int, now: datetime | None
) -> str | None:
    """Take a slot of each other key the attempt lacks (sorted), without waiting and only where no one stands
    before it in that key's line, into ``got``; the first key it could not take (None: it has them all)."""
    for other in sorted(k for k in (cand.keys or ()) if k not in got):
        if _someone_ahead(conn, other, cand, now=now):
            return other
        taken = slots.slots_take_nowait(conn, other, key_name(other), cost=cost, now=now)
        if taken is None:
            return other
        got[other] = taken
    return None


def _move_to_line(
    conn: sa.Connection, cand: Any, key: str, missing: str, got: dict[str, int], *, cost: int, now: datetime | None
) -> None:
    """Move the attempt from the line of ``key`` to the line of ``missing`` (whose head row the caller holds),
    reserving the slots of the keys listed before ``missing`` in the task's order and giving back the others."""
    order = list(cand.keys)
    keep = {k: sh for k, sh in got.items() if order.index(k) < order.index(missing)}
    for k, sh in got.items():  # taken now, or reserved before for a line it no longer stands in
        if k not in keep:
            # A slot it had reserved frees room on a key whose line we cannot lock here (out of lock order):
            # the sweep promotes that line (D2).
            slots.slots_give_back(conn, k, sh, cost=cost, now=now)
    conn.execute(
        waiting.WAITING_MOVE,
        {
            "task_id": cand.task_id,
            "attempt": cand.attempt,
            "to_key": missing,
            "reserved_keys": list(keep) or None,
            "reserved_shards": list(keep.values()) or None,
            "now": now,
        },
    )
    keys.keys_remove_waiting(conn, key, now=now)
    keys.keys_add_waiting(conn, missing, force=True)


#: ``_take_tokens``'s answer when a token bucket's row is busy (taken without waiting: out of lock order).
_BUSY: Any = object()


def _take_tokens(conn: sa.Connection, cand: Any, key: str, *, rated: bool, now: datetime | None) -> Any:
    """Take the tokens a promotion needs from every rate-limited key of the candidate: None when taken (or none
    needed), else the time they will exist, or ``_BUSY`` when another key's bucket row is locked. The line
    key's row is held by the caller; other keys' rows are taken without waiting."""
    cost = tokens_of(int(cand.cost or 1))
    others = [k for k in (cand.keys or ()) if k != key]
    rated_names = (
        set(conn.execute(names.NAMES_RATED, {"names": sorted({key_name(k) for k in others})}).scalars())
        if others
        else set()
    )
    buckets = ([key] if rated else []) + sorted(k for k in others if key_name(k) in rated_names)
    wait_until = None
    for k in buckets:
        if k != key and conn.execute(keys.KEYS_LOCK_NOWAIT, {"key": k}).first() is None:
            return _BUSY
        tokens = keys.keys_take_tokens(conn, k, key_name(k), cost, now=now)
        if not tokens.unrated and not tokens.took:
            wait_until = tokens.next_at if wait_until is None else max(wait_until, tokens.next_at)
    return wait_until


def _holding(cand: Any, got: dict[str, int]) -> claims.Holding:
    """The claim's holding: its first key (in the task's order) and the rest as extra keys."""
    first = cand.keys[0] if cand.keys else cand.key
    extra = tuple(k for k in (cand.keys or ()) if k != first)
    return claims.Holding(
        key=first,
        shard=got[first],
        extra_keys=extra,
        extra_shards=tuple(got[k] for k in extra),
        cost=int(cand.cost or 1),
        fair_key=getattr(cand, "fair_key", None),
    )


def _someone_ahead(conn: sa.Connection, key: str, cand: Any, *, now: datetime | None) -> bool:
    params = {"key": key, "priority": cand.priority, "arrival": cand.arrival, "now": now}
    return bool(conn.execute(waiting.WAITING_AHEAD, params).scalar())


def promote_multi(
    conn: sa.Connection, token: Token, *, dispatch: float = DEFAULT_DISPATCH_TIMEOUT, now: datetime | None = None
) -> list[Promotion]:
    """Promote one parked attempt with several keys if every key has room for it and it is first in every
    key's line — taking every lock in lock order, so it never has to skip a busy row (the sweep's backstop
    for multi-key waiters, D2). The steps: lock every key's slot rows, then head rows, then the waiting row and
    its group (``_multi_candidate``); find room on every key it lacks (``_multi_rooms``); take the slots and the
    tokens, all or none (``_multi_take``); promote."""
    row = conn.execute(waiting.WAITING_KEYS_OF_TOKEN, {"task_id": token.task_id, "attempt": token.attempt}).first()
    if row is None or not row.keys:
        return []
    all_keys = sorted(row.keys)
    uses = {k: slots.slots_lock_all(conn, k, key_name(k), now=now) for k in all_keys}
    for k in all_keys:
        keys.keys_lock(conn, k, key_name(k), now=now)
    cand = _multi_candidate(conn, token, now=now)
    if cand is None:
        return []
    rooms = _multi_rooms(conn, cand, uses, now=now)
    if rooms is None or not _multi_take(conn, cand, all_keys, rooms, now=now):
        return []
    holding = _holding(cand, rooms)
    promotion = _promote_row(
        conn, cand, key=holding.key, shard=holding.shard, holding=holding, dispatch=dispatch, now=now
    )
    keys.keys_remove_waiting(conn, cand.key, now=now)
    return [promotion]


def _multi_candidate(conn: sa.Connection, token: Token, *, now: datetime | None) -> Any:
    """The waiting row of ``token``, locked, when it may start now: due, not past its deadline, its group's head
    and the group not busy (the group row locked); else None."""
    cand = conn.execute(waiting.WAITING_GET_LOCKED, {"task_id": token.task_id, "attempt": token.attempt}).first()
    if cand is None or cand.not_before is not None or cand.group_blocked or clock_is_past(conn, cand.deadline, now):
        return None
    if cand.group_key is not None:
        groups.groups_lock(conn, cand.group_key)
        head, busy = groups.groups_head(conn, cand.group_key)
        if busy or head != cand.group_seq:
            return None
    return cand


def _multi_rooms(
    conn: sa.Connection, cand: Any, uses: dict[str, list[slots.ShardUse]], *, now: datetime | None
) -> dict[str, int] | None:
    """Per key, the shard the attempt holds (reserved before) or would take (room for its cost, nobody ahead of it
    in that key's line); None when a key it lacks has no room for it or a waiter ahead."""
    cost = int(cand.cost or 1)
    rooms = dict(zip(cand.reserved_keys or (), cand.reserved_shards or (), strict=True))
    for k in sorted(k for k in uses if k not in rooms):
        room = next((u.shard for u in uses[k] if u.fits(cost)), None)
        if room is None or _someone_ahead(conn, k, cand, now=now):
            return None
        rooms[k] = room
    return rooms


def _multi_take(
    conn: sa.Connection, cand: Any, all_keys: list[str], rooms: dict[str, int], *, now: datetime | None
) -> bool:
    """Take the slots of the keys not reserved before and a token of every rated key, all or none (a savepoint);
    an empty bucket gives the attempt a not-before time (out of the line until its tokens exist, D2)."""
    cost = int(cand.cost or 1)
    reserved = set(cand.reserved_keys or ())
    savepoint = conn.begin_nested()
    for k in all_keys:
        if k not in reserved and not slots.slots_take(conn, k, key_name(k), rooms[k], cost=cost, now=now):
            savepoint.rollback()
            return False
    wait_until = None
    for k in all_keys:  # every head row is held: the buckets are taken in lock order
        tokens = keys.keys_take_tokens(conn, k, key_name(k), cost, now=now)
        if not tokens.unrated and not tokens.took:
            wait_until = tokens.next_at if wait_until is None else max(wait_until, tokens.next_at)
    if wait_until is not None:
        savepoint.rollback()
        conn.execute(
            waiting.WAITING_NOT_BEFORE, {"task_id": cand.task_id, "attempt": cand.attempt, "not_before": wait_until}
        )
        return False
    savepoint.commit()
    return True


def promote_group(
    conn: sa.Connection,
    group_key: str,
    *,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    local: LocalHandoff | None = None,
    now: datetime | None = None,
) -> list[Promotion]:
    """Start the head of ``group_key`` if it is parked, due, and its group is free. A head that also needs a
    key slot takes one only if free without waiting (SKIP LOCKED: out of lock order); otherwise the key's
    own promotions pick it up, since it is no longer blocked by its group."""
    groups.groups_lock(conn, group_key)
    head, busy = groups.groups_head(conn, group_key)
    if busy or head is None:
        return []
    cand = waiting.waiting_group_member(conn, group_key, head)
    if cand is None or cand.not_before is not None or clock_is_past(conn, cand.deadline, now):
        return []
    if cand.group_blocked:
        waiting.waiting_unblock(conn, group_key, head)
    holding: claims.Holding | None = None
    if cand.key is not None:
        holding = _take_nowait_all(conn, cand, now=now)
        if holding is None:
            return []
        keys.keys_remove_waiting(conn, cand.key, now=now)
    key = cand.key if holding is None else holding.key
    shard = None if holding is None else holding.shard
    return [_promote_row(conn, cand, key=key, shard=shard, holding=holding, dispatch=dispatch, local=local, now=now)]


def _take_nowait_all(conn: sa.Connection, cand: Any, *, now: datetime | None) -> claims.Holding | None:
    """Take every slot a locked waiting row needs without waiting for any lock (the caller holds locks later
    in the lock order), only where no one stands before it in line: all or none."""
    cost = int(cand.cost or 1)
    savepoint = conn.begin_nested()
    got = dict(zip(cand.reserved_keys or (), cand.reserved_shards or (), strict=True))
    ok = conn.execute(keys.KEYS_LOCK_NOWAIT, {"key": cand.key}).first() is not None
    for k in sorted(k for k in (cand.keys or (cand.key,)) if k not in got):
        if not ok:
            break
        if cand.keys and _someone_ahead(conn, k, cand, now=now):
            ok = False
            break
        taken = slots.slots_take_nowait(conn, k, key_name(k), cost=cost, now=now)
        ok = taken is not None
        if taken is not None:
            got[k] = taken
    if ok:
        ok = _take_tokens(conn, cand, cand.key, rated=True, now=now) is None
    if not ok:
        savepoint.rollback()
        return None
    savepoint.commit()
    return _holding(cand, got)


def _promote_row(
    conn: sa.Connection,
    cand: Any,
    *,
    key: str | None,
    shard: int | None,
    dispatch: float,
    holding: claims.Holding | None = None,
    local: LocalHandoff | None = None,
    now: datetime | None = None,
) -> Promotion:
    """Move a locked waiting row into a promoted claim with a fresh nonce (D5), or, for a releaser that will
    run it itself (``local``), straight into a running claim of that releaser (D4); either claim keeps the
    stored row (``parked``)."""
    token = Token(cand.task_id, cand.attempt)
    parked = waiting.waiting_take(conn, token)
    assert parked is not None, "a locked waiting row cannot vanish"
    if local is not None and local.takes(cand):
        nonce = None
        fence = claims.claims_insert_running(
            conn,
            token,
            key=key,
            shard=shard,
            group_key=cand.group_key,
            holder=local.holder,
            lease=local.lease,
            parked=parked,
            holding=holding,
            now=now,
        )
    else:
        nonce = uuid.uuid4()
        fence = claims.claims_insert_promoted(
            conn,
            token,
            key=key,
            shard=shard,
            group_key=cand.group_key,
            nonce=nonce,
            dispatch=dispatch,
            parked=parked,
            holding=holding,
            now=now,
        )
    return Promotion(
        task_id=cand.task_id,
        attempt=cand.attempt,
        nonce=nonce,
        fence=fence,
        key=key,
        group_key=cand.group_key,
        queue=cand.queue,
        message=cand.message,
    )
