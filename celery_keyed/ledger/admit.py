"""Admission: admit-or-park of an arrival (D1, D2, D8, D10), and the binding of a promoted attempt (D5).

Each function runs inside the caller's transaction (``with engine.begin() as conn``), except
``admit_autocommit``, the one-statement fast path (``conn`` in autocommit).

Lock order (every transaction takes row locks in this order, so two of them never wait on each other in a
cycle): the task's ``keyed_tasks`` row → ``keyed_slots`` rows by (key, shard) → the ``keyed_keys`` row →
``keyed_groups`` rows. A step that needs a lock out of that order (promoting a group head that also has a
key) uses SKIP LOCKED and leaves the work to the lock holder or the sweep (D2: within one sweep interval).

No lost wakeups (D2): admit-or-park and release-and-promote both lock what they depend on unconditionally —
the slow path of admission locks every shard row of the key before deciding to park, and a release holds its
shard row while it looks for waiters — so whichever commits second sees the other's work.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import books, claims, driver, fast_paths, groups, keys, names, slots, waiting
from celery_keyed.ledger.attempts import Admission, Arrival, Promotion, TaskOutcome, Token, Verdict
from celery_keyed.ledger.bounds import tokens_of
from celery_keyed.ledger.caps import capped_name
from celery_keyed.ledger.clock import clock_is_future
from celery_keyed.ledger.keyspec import key_name
from celery_keyed.ledger.newest_wins import Cancels, cancel_older
from celery_keyed.ledger.outcomes import finish_never_ran
from celery_keyed.ledger.parking import park
from celery_keyed.ledger.promote import DEFAULT_DISPATCH_TIMEOUT, promote_waiters
from celery_keyed.ledger.redeliveries import known_attempt

#: Shard counts by name seen by this process, with the monotonic time they go stale (see _fast_claim).
_shards_seen: dict[str, tuple[int, float]] = {}


_SHARDS_TTL = 30.0


def _known_single_shard(name: str) -> bool:
    seen = _shards_seen.get(name)
    return seen is not None and seen[0] == 1 and seen[1] > time.monotonic()


def _fast_claim(conn: sa.Connection, name: str, run: Callable[[], Any]) -> Any:
    """Run a fast-path claim statement ``run()`` (it returns a row with ``shard``, NULL on a miss, and
    ``shards``).

    A SKIP LOCKED pick can end up holding the lock of a shard row it did not take (the row changed between
    the snapshot and the lock, and the re-check failed). The slow path then locks every shard in order while
    holding that one: out of lock order, a deadlock with another slow path. So on a sharded name the fast path
    runs in a savepoint and a miss rolls it back, which drops the stray lock; an unsharded name needs none (its
    only row is first in the order). Returns the row, or None after a rolled-back miss."""
    if _known_single_shard(name):
        row = run()
        _shards_seen[name] = (int(row.shards), time.monotonic() + _SHARDS_TTL)
        return row
    savepoint = conn.begin_nested()
    row = run()
    _shards_seen[name] = (int(row.shards), time.monotonic() + _SHARDS_TTL)
    if row.shard is not None:
        savepoint.commit()
        return row
    savepoint.rollback()
    return None


def _arrival_params(
    arrival: Arrival, name: str | None, *, holder: str, lease: float, now: datetime | None
) -> dict[str, Any]:
    """Bind parameters of the arrival statements (fast_paths.CLAIM_NEW, books.BOOKS_ARRIVE_OR_LOCK, SLOTS_CLAIM_ANY)."""
    return {
        "task_id": arrival.task_id,
        "attempt": arrival.attempt,
        "task_name": arrival.task_name,
        "key": arrival.key,
        "group_key": arrival.group_key,
        "extra_keys": list(arrival.extra_keys) or None,  # the books keep every key (None for one)
        "deadline": arrival.deadline,
        "name": name,
        "cost": arrival.cost,
        "fair_key": arrival.fair_key,
        "holder": holder,
        "lease": lease,
        "now": now,
    }


def admit_autocommit(
    conn: sa.Connection, arrival: Arrival, *, holder: str, lease: float, now: datetime | None = None
) -> tuple[Admission | None, bool]:
    """The fast path of a first arrival as one self-committing statement (``conn`` in autocommit): ADMITTED,
    or None — then run ``admit`` in a transaction, with ``fresh=True`` when the second value says this call
    recorded the task's arrival (it is new: no duplicate to look for). Being its own transaction, a stray
    shard lock ends with it (see _fast_claim)."""
    if arrival.key is None or arrival.group_key is not None or arrival.not_before is not None or arrival.exclusive:
        return None, False
    if arrival.debounce is not None or arrival.on_newer is not None:  # decided by admit (it parks / cancels)
        return None, False
    name = key_name(arrival.key)
    params = _arrival_params(arrival, name, holder=holder, lease=lease, now=now)
    if arrival.extra_keys:
        params.update(keys=list(arrival.keys), extra_keys=list(arrival.extra_keys))
        row = driver.one(conn, fast_paths.CLAIM_NEW_MULTI, params)
        if row.shard is None:
            return None, bool(row.new)
        return Admission(Verdict.ADMITTED, fence=row.fence, shard=row.shard), True
    statement = fast_paths.CLAIM_NEW_WAITING if _known_single_shard(name) else fast_paths.CLAIM_NEW
    row = driver.one(conn, statement, params)
    _shards_seen[name] = (int(row.shards), time.monotonic() + _SHARDS_TTL)
    if row.shard is None:
        return None, bool(row.new)
    return Admission(Verdict.ADMITTED, fence=row.fence, shard=row.shard), True


def batchable(arrival: Arrival) -> bool:
    """Whether ``claim_many`` may decide ``arrival``: one key, no group, no not-before time, shared (the shape of
    fast_paths.CLAIM_NEW). Every other arrival takes the per-arrival path."""
    if arrival.debounce is not None or arrival.on_newer is not None:  # decided by admit (it parks / cancels)
        return False
    return (
        arrival.key is not None
        and arrival.group_key is None
        and arrival.not_before is None
        and not arrival.extra_keys
        and not arrival.exclusive
    )


def claim_many(
    conn: sa.Connection, arrivals: Sequence[Arrival], *, holder: str, lease: float, now: datetime | None = None
) -> list[tuple[Admission | None, bool]]:
    """The fast claim of a batch of ``batchable`` arrivals in one call (``conn`` in autocommit: the call is its
    own transaction), in input order: (ADMITTED, True) or (None, fresh) — then admit it on its own, with
    ``fresh`` telling whether this call recorded the task's first arrival. Arrivals of one key are decided in
    input order and an arrival that is not admitted stops the ones of its key behind it (FIFO, D10); task rows are
    locked in task id order, then the slot rows key by key in key order (two batches never deadlock)."""
    params = claim_many_params(arrivals, holder=holder, lease=lease, now=now)
    answers: list[tuple[Admission | None, bool]] = [(None, False)] * len(arrivals)
    for row in driver.run(conn, fast_paths.CLAIM_MANY, params):
        admitted = row.fence is not None
        answers[row.ord - 1] = (
            (Admission(Verdict.ADMITTED, fence=row.fence, shard=row.shard), True) if admitted else (None, bool(row.new))
        )
    return answers


def claim_many_params(
    arrivals: Sequence[Arrival], *, holder: str, lease: float, now: datetime | None = None
) -> dict[str, Any]:
    """The values of ``fast_paths.CLAIM_MANY`` for ``arrivals`` (``claim_many``)."""
    return {
        "task_ids": [a.task_id for a in arrivals],
        "attempts": [a.attempt for a in arrivals],
        "task_names": [a.task_name for a in arrivals],
        "keys": [a.key for a in arrivals],
        "deadlines": [a.deadline for a in arrivals],
        "costs": [a.cost for a in arrivals],
        "fair_keys": [a.fair_key for a in arrivals],
        "holder": holder,
        "lease": lease,
        "now": now,
    }


def plain(arrival: Arrival) -> bool:
    """Whether ``admit_plain`` may decide ``arrival``: one key, no group, no not-before, cost 1, no supersede key,
    no fair weight of its own (the plain path parks without one: waiting.waiting_insert stores it)."""
    return (
        batchable(arrival)
        and arrival.cost == 1
        and arrival.supersede_key is None
        and arrival.fair_weight is None
        and arrival.call_limit is None  # parking at receipt would skip storing its limit (call_limits.store_first)
    )


def park_plain(
    conn: sa.Connection, arrival: Arrival, *, holder: str, lease: float, now: datetime | None = None
) -> Admission | None:
    """Park a ``plain`` arrival at receipt when its key has a line or no room (keyed_admit_or_park_plain with
    p_park_only: the same locks and guards as ``admit_plain``): PARKED, or REJECTED when its waiting room is full;
    None when it is left to its admission once a pool process is ready for it (room and no line, or anything
    ``admit`` must decide). Never takes a slot (D3)."""
    row = driver.one(conn, fast_paths.PARK_PLAIN, _plain_params(arrival, holder=holder, lease=lease, now=now))
    if row.verdict not in ("parked", "rejected"):
        return None
    return Admission(Verdict(row.verdict), detail=row.detail or "")


@dataclasses.dataclass(frozen=True)
class PlainDecision:
    """One answer of ``admit_plain_many``: ``verdict`` as the procedure gave it; ``admission`` when it decided the
    arrival (admitted, parked or rejected: committed); ``new`` whether it recorded the task's first arrival."""

    verdict: str
    admission: Admission | None
    new: bool
    detail: str = ""


def admit_plain_many(
    conn: sa.Connection,
    arrivals: Sequence[Arrival],
    *,
    holder: str,
    lease: float,
    park_only: bool,
    in_order: bool = False,
    now: datetime | None = None,
) -> list[PlainDecision]:
    """Admit-or-park (``park_only``: park at receipt) a batch of ``plain`` arrivals in one round trip, each in its
    own transaction as ``admit_plain`` / ``park_plain`` would decide it (keyed_admit_plain_many, migration 0019;
    ``conn`` in autocommit). In input order; once an arrival is not decided by the call ('general', 'undecided',
    'error'), the later arrivals of its key are 'skipped' (FIFO within a key, D10) — with ``in_order``, every later
    arrival: the caller decides them, in input order, after it."""
    params = {
        "task_ids": [a.task_id for a in arrivals],
        "attempts": [a.attempt for a in arrivals],
        "task_names": [a.task_name for a in arrivals],
        "keys": [a.key for a in arrivals],
        "priorities": [a.priority for a in arrivals],
        "deadlines": [a.deadline for a in arrivals],
        "queues": [a.queue for a in arrivals],
        "messages": [json.dumps(a.message) for a in arrivals],
        "fair_keys": [a.fair_key for a in arrivals],
        "holder": holder,
        "lease": lease,
        "now": now,
        "park_only": park_only,
        "in_order": in_order,
    }
    row = driver.one(conn, fast_paths.ADMIT_PLAIN_MANY, params)
    if len(row.verdicts) != len(arrivals):
        raise RuntimeError(f"keyed_admit_plain_many answered {len(row.verdicts)} verdicts for {len(arrivals)}")
    decisions = []
    for verdict, new, fence, shard, detail in zip(
        row.verdicts, row.news, row.fences, row.shards, row.details, strict=True
    ):
        admission = None
        if verdict in ("admitted", "parked", "rejected"):
            admission = Admission(Verdict(verdict), fence=fence, shard=shard, detail=detail or "")
        decisions.append(PlainDecision(verdict, admission, bool(new), detail or ""))
    return decisions


def _plain_params(arrival: Arrival, *, holder: str, lease: float, now: datetime | None) -> dict[str, Any]:
    return {
        "task_id": arrival.task_id,
        "attempt": arrival.attempt,
        "task_name": arrival.task_name,
        "key": arrival.key,
        "priority": arrival.priority,
        "deadline": arrival.deadline,
        "queue": arrival.queue,
        "message": json.dumps(arrival.message),
        "fair_key": arrival.fair_key,
        "holder": holder,
        "lease": lease,
        "now": now,
    }


def admit_plain(
    conn: sa.Connection, arrival: Arrival, *, holder: str, lease: float, now: datetime | None = None
) -> tuple[Admission | None, bool]:
    """Admit-or-park of a ``plain`` arrival in one call (keyed_admit_plain: the general path's locks and guards,
    in lock order): the Admission (ADMITTED, PARKED or REJECTED), or None when ``admit`` must decide (a known
    token, an expired task, room next to a promotable waiter, a full room under 'supersede', a group member) —
    with whether this call recorded the task's first arrival (pass it on as ``fresh``)."""
    row = driver.one(conn, fast_paths.ADMIT_PLAIN, _plain_params(arrival, holder=holder, lease=lease, now=now))
    if row.verdict == "general":
        return None, bool(row.new)
    return Admission(Verdict(row.verdict), fence=row.fence, shard=row.shard, detail=row.detail or ""), bool(row.new)


def admit(
    conn: sa.Connection,
    arrival: Arrival,
    *,
    holder: str,
    lease: float,
    fresh: bool = False,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: datetime | None = None,
) -> Admission:
    """Admit ``arrival`` (claim a slot: ADMITTED with its fence) or park it durably (PARKED), or record why it
    cannot wait (REJECTED / EXPIRED), or recognise a known attempt token (DUPLICATE, D8). ``fresh``: the caller
    has just recorded this task's first arrival (``admit_autocommit``), and its fast path found no room.

    The bound is enforced by the guarded slot UPDATE (D1). A parked attempt's row is committed with this
    transaction; the caller acks the broker message only after the commit.

    The steps, in order: the fast claim of a known key or the arrival's row (``_arrive``); a known attempt token
    (``redeliveries.known_attempt``, D8); its group number; an expiry or a refusal decided before any slot is looked
    at (``_refused_at_arrival``); the fast claim of a later attempt (``_claim_later_attempt``); newest wins
    (``newest_wins.cancel_older``); the locks on every key's slots and head rows, in lock order, and the line
    started where room waits next to it (a not-before time that passed) (``_lock_rooms``); whether it may start now
    (``_ready_to_start``); the claim (``_claim_locked``), else the park (``parking.park``).
    """
    name = key_name(arrival.key) if arrival.key else None
    params = _arrival_params(arrival, name, holder=holder, lease=lease, now=now)
    fast = _fast_path_applies(arrival, name)
    row, admitted = _arrive(conn, name, params, claim=fast and not fresh)
    if admitted is not None:
        return admitted
    # A fresh arrival still looks for its token: a concurrent delivery of the same task may have won.
    known = None if row.new else known_attempt(conn, arrival, row, name=name, now=now)
    if known is not None:
        return known

    group_seq = _group_seq(conn, arrival, now=now) if arrival.group_key else None

    refused = _refused_at_arrival(conn, arrival, expired=row.expired, now=now)
    if refused is not None:
        return refused

    # Fast path of a later attempt (retry, redelivery), now that D8 has been checked.
    if fast and not row.new and not fresh and arrival.key and name:
        admitted = _claim_later_attempt(conn, arrival, name, params, holder=holder, lease=lease, now=now)
        if admitted is not None:
            return admitted

    # Newest wins: ask for the cancellation of the older attempt of its key and supersede key. Its claim row is
    # locked before the slot rows, the order a release takes them in (claim, task, slots): no cycle.
    cancels = cancel_older(conn, arrival, now=now)
    rooms, promoted = _lock_rooms(conn, arrival, dispatch=dispatch, now=now)
    is_head, ready = _ready_to_start(conn, arrival, rooms, group_seq=group_seq, now=now)
    if ready:
        admitted, arrival = _claim_locked(
            conn, arrival, rooms, holder=holder, lease=lease, promoted=promoted, cancels=cancels, now=now
        )
        if admitted is not None:
            return admitted
    return park(
        conn, arrival, rooms, name=name, group_seq=group_seq, is_head=is_head, promoted=promoted, cancels=cancels,
        now=now,
    )



def _fast_path_applies(arrival: Arrival, name: str | None) -> bool:
    """Whether a one-statement claim may decide ``arrival``: one key, no group, no not-before time, not exclusive,
    not debounced, not newest-wins."""
    return (
        arrival.key is not None
        and name is not None
        and not arrival.group_key
        and arrival.not_before is None
        and not arrival.extra_keys
        and not arrival.exclusive
        and arrival.debounce is None
        and arrival.on_newer is None
    )


def _arrive(
    conn: sa.Connection, name: str | None, params: dict[str, Any], *, claim: bool
) -> tuple[Any, Admission | None]:
    """The fast claim of a known key with room (``claim``: ADMITTED, decided), else the arrival's row in the books,
    recorded or locked (``books_arrive_or_lock``; the fast claim's row when it recorded it)."""
    row: Any = None
    if claim:
        assert name is not None
        row = _fast_claim(conn, name, lambda: conn.execute(fast_paths.CLAIM_NEW, params).one())
        if row is not None and row.shard is not None:
            return row, Admission(Verdict.ADMITTED, fence=row.fence, shard=row.shard)
    if row is None:
        row = conn.execute(books.BOOKS_ARRIVE_OR_LOCK, params).one()
    return row, None


def _refused_at_arrival(
    conn: sa.Connection, arrival: Arrival, *, expired: bool, now: datetime | None
) -> Admission | None:
    """EXPIRED (its latest start passed) or REJECTED (an exclusive attempt no key can hold), recorded; else None."""
    if expired:
        finish_never_ran(conn, arrival.token, TaskOutcome.EXPIRED, detail="expired before start", now=now)
        return Admission(Verdict.EXPIRED, detail="expired before start")
    refused = _exclusive_refused(conn, arrival) if arrival.exclusive else None
    if refused is not None:
        finish_never_ran(conn, arrival.token, TaskOutcome.REJECTED, detail=refused, now=now)
        return Admission(Verdict.REJECTED, detail=refused)
    return None


def _claim_later_attempt(
    conn: sa.Connection,
    arrival: Arrival,
    name: str,
    params: dict[str, Any],
    *,
    holder: str,
    lease: float,
    now: datetime | None,
) -> Admission | None:
    """The fast claim of a later attempt (a retry, a redelivery) on any shard with room: ADMITTED, or None."""
    key = arrival.key
    assert key is not None
    claim = _fast_claim(conn, name, lambda: conn.execute(slots.SLOTS_CLAIM_ANY, params).one())
    if claim is None or claim.shard is None:
        return None
    fence = claims.claims_insert_running(
        conn,
        arrival.token,
        key=key,
        shard=claim.shard,
        group_key=None,
        holder=holder,
        lease=lease,
        holding=claims.Holding(key, claim.shard, cost=arrival.cost, fair_key=arrival.fair_key),
        now=now,
    )
    return Admission(Verdict.ADMITTED, fence=fence, shard=claim.shard)


def _lock_rooms(
    conn: sa.Connection, arrival: Arrival, *, dispatch: float, now: datetime | None
) -> tuple[dict[str, int | None], list[Promotion]]:
    """Slow path: lock everything the decision depends on, in lock order (every key's shard rows, keys sorted,
    then their head rows). Per key, the shard with room for the arrival (None: no room), and the promotions made
    on the way (a line next to room, see below). Several keys: all have room or the attempt parks (all-or-nothing)."""
    rooms: dict[str, int | None] = {}
    uses: dict[str, list[slots.ShardUse]] = {}
    for k in sorted(arrival.keys):
        uses[k] = slots.slots_lock_all(conn, k, key_name(k), now=now)
        rooms[k] = next((u.shard for u in uses[k] if u.fits(arrival.cost)), None)
    for k in sorted(arrival.keys):
        keys.keys_lock(conn, k, key_name(k), now=now)
    promoted: list[Promotion] = []
    for k in sorted(arrival.keys):
        free = [u.shard for u in uses[k] for _ in range(max(0, u.share - u.used))]
        if free and conn.execute(waiting.WAITING_PROMOTABLE_EXISTS, {"key": k, "now": now}).scalar():
            # A free slot with a line in front of it belongs to the line's head (FIFO, D10). Such a line exists
            # next to room only when time made a waiter eligible (its not-before time passed) and no sweep has
            # run yet, or when this arrival's call raised the key's limit: start it now, with the locks held,
            # rather than leave the room idle until the sweep (whether or not the room fits this arrival).
            promoted += promote_waiters(conn, k, free, dispatch=dispatch, now=now)
            uses[k] = slots.slots_lock_all(conn, k, key_name(k), now=now)
            rooms[k] = next((u.shard for u in uses[k] if u.fits(arrival.cost)), None)
            if rooms[k] is not None and conn.execute(
                waiting.WAITING_PROMOTABLE_EXISTS, {"key": k, "now": now}
            ).scalar():
                rooms[k] = None
    return rooms, promoted


def _ready_to_start(
    conn: sa.Connection, arrival: Arrival, rooms: dict[str, int | None], *, group_seq: int | None,
    now: datetime | None,
) -> tuple[bool, bool]:
    """(Whether the arrival heads its group, not held for an operator — True without a group: else it parks blocked
    by its group —, whether it may start now: room on every key, its group's head and not busy, due, not
    debounced). Locks its group's row."""
    has_room = all(shard is not None for shard in rooms.values())
    head_ready = True
    is_head = True
    if arrival.group_key:
        groups.groups_lock(conn, arrival.group_key)
        head, busy, held = groups.groups_head_held(conn, arrival.group_key)
        head_ready = head == group_seq and not busy
        is_head = head == group_seq and not held
    not_due = arrival.not_before is not None and clock_is_future(conn, arrival.not_before, now)
    if arrival.debounce is not None:
        not_due = True  # a debounced arrival always waits out its quiet period, room or not (parking._debounce)
    return is_head, (arrival.key is None or has_room) and head_ready and not not_due


def _claim_locked(
    conn: sa.Connection,
    arrival: Arrival,
    rooms: dict[str, int | None],
    *,
    holder: str,
    lease: float,
    promoted: list[Promotion],
    cancels: Cancels,
    now: datetime | None,
) -> tuple[Admission | None, Arrival]:
    """Claim the rooms found under the locks: ADMITTED; or None when a guarded UPDATE took nothing after all, or a
    rate limit has no tokens yet (then the arrival, returned with its not-before time set to when they exist, parks:
    no polling, no broker churn; its key has no room in ``rooms``)."""
    room = rooms.get(arrival.key) if arrival.key else None
    # The guarded UPDATEs are the authority: the limit may have changed since the rows were read.
    holding, wait_for = (
        _take_locked(conn, arrival, rooms, now=now) if arrival.key else (claims.Holding(None, None), None)
    )
    if wait_for is not None:  # a rate limit: park until its tokens exist (no polling, no broker churn)
        arrival = dataclasses.replace(arrival, not_before=wait_for[1])
        rooms[wait_for[0]] = None
    if holding is None:
        return None, arrival
    fence = claims.claims_insert_running(
        conn,
        arrival.token,
        key=arrival.key,
        shard=room if arrival.key else None,
        group_key=arrival.group_key,
        holder=holder,
        lease=lease,
        holding=holding,
        supersede_key=arrival.supersede_key if arrival.on_newer else None,
        now=now,
    )
    admitted = Admission(Verdict.ADMITTED, fence=fence, shard=room, promotions=tuple(promoted), cancels=cancels)
    return admitted, arrival


def _take_locked(
    conn: sa.Connection, arrival: Arrival, rooms: dict[str, int | None], *, now: datetime | None
) -> tuple[claims.Holding | None, tuple[str, Any] | None]:
    """Take ``arrival.cost`` slots of every key on the shard found for it, and as many tokens of every
    rate-limited key (rows the caller holds locked): all of them or none (a savepoint undoes a partial take).
    Returns the holding, or None and — when a token bucket is empty — (its key, when the tokens will exist)."""
    assert arrival.key is not None
    savepoint = conn.begin_nested()
    for k in sorted(arrival.keys):
        tokens = keys.keys_take_tokens(conn, k, key_name(k), tokens_of(arrival.cost), now=now)
        if not tokens.unrated and not tokens.took:
            savepoint.rollback()
            return None, (k, tokens.next_at)
    for k in sorted(arrival.keys):
        shard = rooms[k]
        if shard is None or not slots.slots_take(conn, k, key_name(k), shard, cost=arrival.cost, now=now):
            savepoint.rollback()
            return None, None
    savepoint.commit()
    return claims.Holding(
        key=arrival.key,
        shard=rooms[arrival.key],
        extra_keys=arrival.extra_keys,
        extra_shards=tuple(int(rooms[k]) for k in arrival.extra_keys),  # type: ignore[arg-type]
        cost=arrival.cost,
        fair_key=arrival.fair_key,
    ), None


def _exclusive_refused(conn: sa.Connection, arrival: Arrival) -> str | None:
    """Why an exclusive attempt (readers and writers) can never start, or None: it has one concurrency key, on a
    name with one shard (a sharded gate has no row whose lock covers the whole key; the guard FITS refuses it
    there too)."""
    if arrival.key is not None and arrival.extra_keys and all(capped_name(k) for k in arrival.extra_keys):
        return f"an exclusive attempt cannot run on {key_name(arrival.key)}: the name has a cap (caps count slots)"
    if arrival.key is None or arrival.extra_keys:
        return "an exclusive attempt needs exactly one concurrency key"
    name = key_name(arrival.key)
    if conn.execute(names.NAMES_SHARDS, {"name": name}).scalar_one() != 1:
        return f"an exclusive attempt cannot run on {name}: the name is sharded"
    return None


def bind(
    conn: sa.Connection, token: Token, nonce: uuid.UUID, *, holder: str, lease: float, now: datetime | None = None
) -> int | None:
    """Bind a promoted attempt to the worker that is about to run it (D5); its fence, or None when the token
    and nonce are not a live promotion (copied, forged, voided or already bound: admit it as usual)."""
    return claims.claims_bind_promoted(conn, token, nonce, holder=holder, lease=lease, now=now)


def _group_seq(conn: sa.Connection, arrival: Arrival, *, now: datetime | None) -> int:
    """The arrival's number in its group: its existing membership (registered at publish, or a previous
    attempt), else a number allocated now (a producer that did not register: ordered by receipt, D10)."""
    assert arrival.group_key is not None
    member = groups.members_get(conn, arrival.task_id)
    if member is not None:
        if not member.received:
            conn.execute(groups.MEMBERS_MARK_RECEIVED, {"task_id": arrival.task_id})
        return int(member.seq)
    return groups.groups_register(conn, arrival.group_key, arrival.task_id, received=True, now=now)
