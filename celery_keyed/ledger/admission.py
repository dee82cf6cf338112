"""Admission, release and promotion: the ledger's transactions, composed of the guarded statements of the
table modules. Each function runs inside the caller's transaction (``with engine.begin() as conn``).

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
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import books, claims, groups, keys, slots, waiting
from celery_keyed.ledger.attempts import Admission, Arrival, Outcome, Promotion, ReleaseReport, Token, Verdict
from celery_keyed.ledger.clock import NOW
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

# arrive_or_lock: record the arrival of a task id, or lock its existing row so that two deliveries of one
# task are admitted one after the other (the second sees the first's claim or park: D8). xmax = 0 ⇔ inserted.
ARRIVE_OR_LOCK = sa.text(
    f"""
    INSERT INTO keyed_tasks (task_id, task_name, key, group_key, arrived_at)
    VALUES (:task_id, :task_name, :key, :group_key, {NOW})
    ON CONFLICT (task_id) DO UPDATE SET task_id = excluded.task_id
    RETURNING (xmax = 0) AS new, outcome, finished_attempt,
              COALESCE(CAST(:deadline AS timestamptz) <= {NOW}, false) AS expired
    """
)

# lock_task: the task's row, first in the lock order (serialises deliveries and releases of one task).
LOCK_TASK = sa.text("SELECT 1 FROM keyed_tasks WHERE task_id = :task_id FOR UPDATE")

# token_state: what the ledger holds for an attempt token (D8): a claim (running / promoted) or a parked row.
TOKEN_STATE = sa.text(
    """
    SELECT 'claim' AS kind, state AS detail FROM keyed_claims WHERE task_id = :task_id AND attempt = :attempt
    UNION ALL
    SELECT 'waiting', CASE WHEN shadow THEN 'shadow' ELSE 'parked' END
      FROM keyed_waiting WHERE task_id = :task_id AND attempt = :attempt
    """
)


# claim_new: the fast path of a first arrival, in one statement: record the arrival (or lock the task's row,
# as ARRIVE_OR_LOCK) and, for a new task id that has not expired, take a slot on any shard with room that no
# other transaction holds and insert the claim. The task row is locked before any slot row (lock order): the
# slot rows are only reached through the join with ``arr``. Also returns the name's shard count (see
# _fast_claim for why it matters).
_CLAIM_NEW = """
    WITH arr AS (
        INSERT INTO keyed_tasks (task_id, task_name, key, group_key, arrived_at)
        VALUES (:task_id, :task_name, :key, NULL, {NOW})
        ON CONFLICT (task_id) DO UPDATE SET task_id = excluded.task_id
        RETURNING (xmax = 0) AS new, outcome, finished_attempt,
                  COALESCE(CAST(:deadline AS timestamptz) <= {NOW}, false) AS expired
    ), lim AS (
        SELECT keyed_effective_limit(:name, {NOW}) AS k, keyed_name_shards(:name) AS n,
               (SELECT c.rate FROM keyed_names c WHERE c.name = :name) AS rate
    ), pick AS (
        SELECT s.shard FROM keyed_slots s, lim, arr
         WHERE arr.new AND NOT arr.expired AND lim.rate IS NULL
           AND s.key = :key AND s.used + :cost <= keyed_shard_share(lim.k, lim.n, s.shard) AND NOT {PROMOTABLE}
         ORDER BY random() LIMIT 1
         FOR UPDATE OF s {lock_wait}
    ), took AS (
        UPDATE keyed_slots s SET used = s.used + :cost
          FROM pick, lim
         WHERE s.key = :key AND s.shard = pick.shard AND s.used + :cost <= keyed_shard_share(lim.k, lim.n, s.shard)
        RETURNING s.shard
    ), claimed AS (
        INSERT INTO keyed_claims (task_id, attempt, key, shard, group_key, state, fence, holder,
                                  lease_expires_at, claimed_at, cost, fair_key)
        SELECT :task_id, :attempt, :key, took.shard, NULL, 'running', nextval('keyed_fence_seq'), :holder,
               {NOW} + make_interval(secs => :lease), {NOW}, :cost, :fair_key
          FROM took
        RETURNING fence, shard
    )
    SELECT arr.new, arr.outcome, arr.finished_attempt, arr.expired, lim.n AS shards,
           (SELECT fence FROM claimed) AS fence, (SELECT shard FROM claimed) AS shard
      FROM arr, lim
    """
_CLAIM_NEW = _CLAIM_NEW.replace("{PROMOTABLE}", waiting.PROMOTABLE_EXISTS).replace("{NOW}", NOW)
CLAIM_NEW = sa.text(_CLAIM_NEW.replace("{lock_wait}", "SKIP LOCKED"))
# claim_new_waiting: the same for a name with one shard: wait for its only row like any counter update (a
# lock it keeps after a failed re-check is the first in the lock order anyway).
CLAIM_NEW_WAITING = sa.text(_CLAIM_NEW.replace("{lock_wait}", ""))

# claim_new_multi: the fast path of a first arrival with several keys, in one statement, all or nothing: for
# every key pick a shard with room for ``cost`` that no other transaction holds (SKIP LOCKED: never waits, so
# no lock order is needed) and that no one waits for; only when every key got one are they all taken and the
# claim inserted. A row locked by the pick was re-checked under its lock (and nobody else can change it while
# it is held; the limits are read in this statement's snapshot), so the take cannot fail for one of them. A
# miss changes nothing and its locks end with the statement (autocommit).
CLAIM_NEW_MULTI = sa.text(
    f"""
    WITH arr AS (
        INSERT INTO keyed_tasks (task_id, task_name, key, group_key, arrived_at)
        VALUES (:task_id, :task_name, :key, NULL, {NOW})
        ON CONFLICT (task_id) DO UPDATE SET task_id = excluded.task_id
        RETURNING (xmax = 0) AS new, outcome, finished_attempt,
                  COALESCE(CAST(:deadline AS timestamptz) <= {NOW}, false) AS expired
    ), want AS (
        SELECT w.key, w.ord, split_part(w.key, ':', 1) AS name
          FROM unnest(CAST(:keys AS text[])) WITH ORDINALITY AS w(key, ord)
    ), lim AS (
        SELECT want.key, want.ord, keyed_effective_limit(want.name, {NOW}) AS k, keyed_name_shards(want.name) AS n,
               (SELECT c.rate FROM keyed_names c WHERE c.name = want.name) AS rate
          FROM want
    ), pick AS (
        SELECT lim.key, lim.ord, p.shard
          FROM arr, lim, LATERAL (
               SELECT s.shard FROM keyed_slots s
                WHERE s.key = lim.key AND s.used + :cost <= keyed_shard_share(lim.k, lim.n, s.shard)
                  AND NOT EXISTS (
                      SELECT 1 FROM keyed_waiting w
                       WHERE w.key = lim.key AND NOT w.shadow AND (w.not_before IS NULL OR w.not_before <= {NOW})
                         AND NOT w.group_blocked AND (w.deadline IS NULL OR w.deadline > {NOW}))
                ORDER BY random() LIMIT 1
                FOR UPDATE OF s SKIP LOCKED) p
         WHERE arr.new AND NOT arr.expired AND lim.rate IS NULL
    ), complete AS (
        SELECT count(*) = cardinality(CAST(:keys AS text[])) AS ok FROM pick
    ), took AS (
        UPDATE keyed_slots s SET used = s.used + :cost
          FROM pick, complete
         WHERE complete.ok AND s.key = pick.key AND s.shard = pick.shard
        RETURNING s.key
    ), claimed AS (
        INSERT INTO keyed_claims (task_id, attempt, key, shard, group_key, state, fence, holder,
                                  lease_expires_at, claimed_at, cost, extra_keys, extra_shards, fair_key)
        SELECT :task_id, :attempt, :key, (SELECT shard FROM pick WHERE ord = 1), NULL, 'running',
               nextval('keyed_fence_seq'), :holder, {NOW} + make_interval(secs => :lease), {NOW}, :cost,
               CAST(:extra_keys AS text[]), ARRAY(SELECT shard FROM pick WHERE ord > 1 ORDER BY ord), :fair_key
          FROM complete WHERE complete.ok
        RETURNING fence, shard
    )
    SELECT arr.new, arr.outcome, arr.finished_attempt, arr.expired, 1 AS shards,
           (SELECT fence FROM claimed) AS fence, (SELECT shard FROM claimed) AS shard
      FROM arr
    """
)

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


def _arrival_params(arrival: Arrival, name: str | None, *, holder: str, lease: float, now: Any) -> dict[str, Any]:
    """Bind parameters of the arrival statements (CLAIM_NEW, ARRIVE_OR_LOCK, SLOTS_CLAIM_ANY)."""
    return {
        "task_id": arrival.task_id,
        "attempt": arrival.attempt,
        "task_name": arrival.task_name,
        "key": arrival.key,
        "group_key": arrival.group_key,
        "deadline": arrival.deadline,
        "name": name,
        "cost": arrival.cost,
        "fair_key": arrival.fair_key,
        "holder": holder,
        "lease": lease,
        "now": now,
    }


def admit_autocommit(
    conn: sa.Connection, arrival: Arrival, *, holder: str, lease: float, now: Any = None
) -> tuple[Admission | None, bool]:
    """The fast path of a first arrival as one self-committing statement (``conn`` in autocommit): ADMITTED,
    or None — then run ``admit`` in a transaction, with ``fresh=True`` when the second value says this call
    recorded the task's arrival (it is new: no duplicate to look for). Being its own transaction, a stray
    shard lock ends with it (see _fast_claim)."""
    if arrival.key is None or arrival.group_key is not None or arrival.not_before is not None:
        return None, False
    name = key_name(arrival.key)
    params = _arrival_params(arrival, name, holder=holder, lease=lease, now=now)
    if arrival.extra_keys:
        params.update(keys=list(arrival.keys), extra_keys=list(arrival.extra_keys))
        row = conn.execute(CLAIM_NEW_MULTI, params).one()
        if row.shard is None:
            return None, bool(row.new)
        return Admission(Verdict.ADMITTED, fence=row.fence, shard=row.shard), True
    statement = CLAIM_NEW_WAITING if _known_single_shard(name) else CLAIM_NEW
    row = conn.execute(statement, params).one()
    _shards_seen[name] = (int(row.shards), time.monotonic() + _SHARDS_TTL)
    if row.shard is None:
        return None, bool(row.new)
    return Admission(Verdict.ADMITTED, fence=row.fence, shard=row.shard), True


def admit(
    conn: sa.Connection,
    arrival: Arrival,
    *,
    holder: str,
    lease: float,
    fresh: bool = False,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: Any = None,
) -> Admission:
    """Admit ``arrival`` (claim a slot: ADMITTED with its fence) or park it durably (PARKED), or record why it
    cannot wait (REJECTED / EXPIRED), or recognise a known attempt token (DUPLICATE, D8). ``fresh``: the caller
    has just recorded this task's first arrival (``admit_autocommit``), and its fast path found no room.

    The bound is enforced by the guarded slot UPDATE (D1). A parked attempt's row is committed with this
    transaction; the caller acks the broker message only after the commit.
    """
    token = arrival.token
    name = key_name(arrival.key) if arrival.key else None
    params = _arrival_params(arrival, name, holder=holder, lease=lease, now=now)
    fast = (
        arrival.key is not None
        and name is not None
        and not arrival.group_key
        and arrival.not_before is None
        and not arrival.extra_keys
    )
    row: Any = None
    if fast and not fresh:
        assert name is not None
        row = _fast_claim(conn, name, lambda: conn.execute(CLAIM_NEW, params).one())
        if row is not None and row.shard is not None:
            return Admission(Verdict.ADMITTED, fence=row.fence, shard=row.shard)
    if row is None:
        row = conn.execute(ARRIVE_OR_LOCK, params).one()
    # A fresh arrival still looks for its token: a concurrent delivery of the same task may have won.
    if not row.new:
        if row.outcome is not None or row.finished_attempt >= arrival.attempt:
            books.books_count_duplicate(conn, arrival.task_id)
            return Admission(Verdict.DUPLICATE, detail=f"finished ({row.outcome or 'attempt over'})")
        held = conn.execute(TOKEN_STATE, {"task_id": token.task_id, "attempt": token.attempt}).first()
        if held is not None:
            return _duplicate(conn, arrival, held.kind, held.detail, name=name, now=now)

    group_seq = _group_seq(conn, arrival, now=now) if arrival.group_key else None

    if row.expired:
        _finish_never_ran(conn, token, "expired", detail="expired before start", now=now)
        return Admission(Verdict.EXPIRED, detail="expired before start")

    # Fast path of a later attempt (retry, redelivery), now that D8 has been checked.
    if fast and not row.new and not fresh and arrival.key and name:
        key = arrival.key
        claim = _fast_claim(conn, name, lambda: conn.execute(slots.SLOTS_CLAIM_ANY, params).one())
        if claim is not None and claim.shard is not None:
            fence = claims.claims_insert_running(
                conn,
                token,
                key=key,
                shard=claim.shard,
                group_key=None,
                holder=holder,
                lease=lease,
                holding=claims.Holding(key, claim.shard, cost=arrival.cost, fair_key=arrival.fair_key),
                now=now,
            )
            return Admission(Verdict.ADMITTED, fence=fence, shard=claim.shard)

    # Slow path: lock everything the decision depends on, in lock order (every key's shard rows, keys sorted,
    # then their head rows), then decide. Several keys: all have room or the attempt parks (all-or-nothing).
    rooms: dict[str, int | None] = {}
    uses: dict[str, list[slots.ShardUse]] = {}
    for k in sorted(arrival.keys):
        uses[k] = slots.slots_lock_all(conn, k, key_name(k), now=now)
        rooms[k] = next((u.shard for u in uses[k] if u.fits(arrival.cost)), None)
    for k in sorted(arrival.keys):
        keys.keys_lock(conn, k, key_name(k), now=now)
    promoted: list[Promotion] = []
    for k in sorted(arrival.keys):
        if rooms[k] is not None and conn.execute(waiting.WAITING_PROMOTABLE_EXISTS, {"key": k, "now": now}).scalar():
            # A free slot with a line in front of it belongs to the line's head (FIFO, D10). Such a line exists
            # next to room only when time made a waiter eligible (its not-before time passed) and no sweep has
            # run yet: start it now, with the locks held, rather than leave the room idle until the sweep.
            free = [u.shard for u in uses[k] for _ in range(max(0, u.share - u.used))]
            promoted += _promote_waiters(conn, k, free, dispatch=dispatch, now=now)
            uses[k] = slots.slots_lock_all(conn, k, key_name(k), now=now)
            rooms[k] = next((u.shard for u in uses[k] if u.fits(arrival.cost)), None)
            if rooms[k] is not None and conn.execute(
                waiting.WAITING_PROMOTABLE_EXISTS, {"key": k, "now": now}
            ).scalar():
                rooms[k] = None
    room = rooms.get(arrival.key) if arrival.key else None
    has_room = all(shard is not None for shard in rooms.values())
    head_ready = True
    is_head = True
    if arrival.group_key:
        groups.groups_lock(conn, arrival.group_key)
        head, busy = groups.groups_head(conn, arrival.group_key)
        is_head = head == group_seq
        head_ready = is_head and not busy
    not_due = arrival.not_before is not None and _is_future(conn, arrival.not_before, now)

    if (arrival.key is None or has_room) and head_ready and not not_due:
        # The guarded UPDATEs are the authority: the limit may have changed since the rows were read.
        holding, wait_for = (
            _take_locked(conn, arrival, rooms, now=now) if arrival.key else (claims.Holding(None, None), None)
        )
        if wait_for is not None:  # a rate limit: park until its tokens exist (no polling, no broker churn)
            arrival = dataclasses.replace(arrival, not_before=wait_for[1])
            rooms[wait_for[0]] = None
        if holding is not None:
            fence = claims.claims_insert_running(
                conn,
                token,
                key=arrival.key,
                shard=room if arrival.key else None,
                group_key=arrival.group_key,
                holder=holder,
                lease=lease,
                holding=holding,
                now=now,
            )
            return Admission(Verdict.ADMITTED, fence=fence, shard=room, promotions=tuple(promoted))

    too_heavy = _too_heavy(conn, arrival) if arrival.cost > 1 else None
    if too_heavy is not None:
        _finish_never_ran(conn, token, "rejected", detail=too_heavy, now=now)
        return Admission(Verdict.REJECTED, detail=too_heavy, promotions=tuple(promoted))
    # Park in the line of the first key (in the task's order) without room for it; an attempt that waits for
    # its group or its not-before time stands in its first key's line.
    line = next((k for k in arrival.keys if rooms[k] is None), arrival.key)
    superseded: list[str] | None = []
    if line is not None:
        superseded = _make_place(conn, arrival, line, now=now)
        if superseded is None:
            detail = f"waiting room of {line} is full"
            _finish_never_ran(conn, token, "rejected", detail=detail, now=now)
            return Admission(Verdict.REJECTED, detail=detail, promotions=tuple(promoted))
    waiting.waiting_insert(
        conn, arrival, name=name, group_seq=group_seq, group_blocked=not is_head, line=line, now=now
    )
    return Admission(Verdict.PARKED, superseded=tuple(superseded or ()), promotions=tuple(promoted))


def _take_locked(
    conn: sa.Connection, arrival: Arrival, rooms: dict[str, int | None], *, now: Any
) -> tuple[claims.Holding | None, tuple[str, Any] | None]:
    """Take ``arrival.cost`` slots of every key on the shard found for it, and as many tokens of every
    rate-limited key (rows the caller holds locked): all of them or none (a savepoint undoes a partial take).
    Returns the holding, or None and — when a token bucket is empty — (its key, when the tokens will exist)."""
    assert arrival.key is not None
    savepoint = conn.begin_nested()
    for k in sorted(arrival.keys):
        tokens = keys.keys_take_tokens(conn, k, key_name(k), arrival.cost, now=now)
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


# names_largest_share: the most slots one claim can take on a key of each name (a shard's share of the
# configured limit; an override may lower it for a while, but the configuration is what can ever be had).
NAMES_LARGEST_SHARE = sa.text(
    """
    SELECT n.name, LEAST(COALESCE(keyed_shard_share(c.slot_limit, c.shards, 0), 1),
                         CASE WHEN c.rate IS NOT NULL THEN CAST(floor(COALESCE(c.burst, 1)) AS integer) END) AS share
      FROM unnest(CAST(:names AS text[])) AS n(name) LEFT JOIN keyed_names c ON c.name = n.name
    """
)


def _too_heavy(conn: sa.Connection, arrival: Arrival) -> str | None:
    """Why an attempt of this cost can never start (it needs more slots than a key of its name can have), or
    None. Bad input gets a recorded rejection instead of waiting for ever."""
    names = sorted({key_name(k) for k in arrival.keys})
    for row in conn.execute(NAMES_LARGEST_SHARE, {"names": names}):
        if arrival.cost > row.share:
            return f"cost {arrival.cost} exceeds the {row.share} slots (or tokens) a key of {row.name} can have"
    return None


def bind(
    conn: sa.Connection, token: Token, nonce: uuid.UUID, *, holder: str, lease: float, now: Any = None
) -> int | None:
    """Bind a promoted attempt to the worker that is about to run it (D5); its fence, or None when the token
    and nonce are not a live promotion (copied, forged, voided or already bound: admit it as usual)."""
    return claims.claims_bind_promoted(conn, token, nonce, holder=holder, lease=lease, now=now)


# release_fast: the release of a claim without a group, in one statement: delete the claim (only the owner
# of this exact fence gets the row: release exactly once), record the outcome in the books, give every slot it
# held back to the shard it came from (its first key and any extra keys, ``cost`` each). ``b`` is joined
# before the slot rows are locked so the task row is locked first, and the slot rows are locked in (key,
# shard) order (lock order). Whether anyone waits is NOT read here: this statement's snapshot predates the wait
# for the slot rows' locks; the caller reads it in a later statement (D2).
RELEASE_FAST = sa.text(
    f"""
    WITH c AS (
        DELETE FROM keyed_claims
         WHERE task_id = :task_id AND attempt = :attempt AND fence = :fence AND state = 'running'
           AND group_key IS NULL
        RETURNING task_id, attempt, key, shard, fence, cost, extra_keys, extra_shards
    ), b AS (
        UPDATE keyed_tasks t
           SET outcome = COALESCE(t.outcome, CAST(:final AS text)),
               finished_at = COALESCE(t.finished_at, CASE WHEN CAST(:final AS text) IS NOT NULL THEN {NOW} END),
               detail = CASE WHEN t.outcome IS NULL AND CAST(:final AS text) IS NOT NULL THEN :detail
                             ELSE t.detail END,
               finished_attempt = GREATEST(t.finished_attempt, c.attempt)
          FROM c
         WHERE t.task_id = c.task_id AND :over AND (CAST(:final AS text) IS NULL OR t.outcome IS NULL)
        RETURNING t.task_id, CAST(:final AS text) IS NOT NULL AS recorded
    ), held AS (
        SELECT c.key, c.shard, c.cost FROM c WHERE c.key IS NOT NULL
        UNION ALL
        SELECT x.key, x.shard, c.cost FROM c, unnest(c.extra_keys, c.extra_shards) AS x(key, shard)
    ), lk AS MATERIALIZED (
        SELECT sl.key, sl.shard, h.cost FROM keyed_slots sl
          JOIN held h ON h.key = sl.key AND h.shard = sl.shard
          LEFT JOIN b ON true
         ORDER BY sl.key, sl.shard
           FOR UPDATE OF sl
    ), s AS (
        UPDATE keyed_slots sl SET used = sl.used - lk.cost
          FROM lk
         WHERE sl.key = lk.key AND sl.shard = lk.shard
        RETURNING sl.key, sl.shard,
                  GREATEST(keyed_shard_share(keyed_effective_limit(sl.name, {NOW}), keyed_name_shards(sl.name),
                                             sl.shard) - sl.used, 0) AS free
    )
    SELECT c.task_id, c.attempt, c.key, c.shard, c.fence,
           ARRAY(SELECT s.key FROM s WHERE s.free > 0 ORDER BY s.key, s.shard) AS room_keys,
           ARRAY(SELECT s.shard FROM s WHERE s.free > 0 ORDER BY s.key, s.shard) AS room_shards,
           ARRAY(SELECT s.free FROM s WHERE s.free > 0 ORDER BY s.key, s.shard) AS room_free,
           COALESCE((SELECT recorded FROM b), false) AS recorded,
           EXISTS (SELECT 1 FROM keyed_waiting w
                    WHERE w.task_id = c.task_id AND w.attempt = c.attempt AND w.shadow) AS has_shadow
      FROM c
    """
)

# keys_waiting: whether a key has parked attempts, read after the slot row's lock is held (a new snapshot:
# an attempt parked by a transaction that held that lock before us is seen, D2).
KEYS_WAITING = sa.text("SELECT waiting FROM keyed_keys WHERE key = :key")


def release(
    conn: sa.Connection,
    token: Token,
    fence: int,
    outcome: Outcome,
    *,
    detail: str = "",
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    local: LocalHandoff | None = None,
    uncertain: bool = False,
    hold: float | None = None,
    now: Any = None,
) -> ReleaseReport:
    """Release the claim of ``token`` held with ``fence`` after ``outcome``, and promote what that makes ready.

    Idempotent and fenced: only the call whose DELETE returns the claim row gives the slot back; a second call,
    a stale worker (old fence) or a lost race with the reaper returns ``released=False`` and changes nothing.

    ``uncertain``: the attempt ended by a hard time limit or a lost worker, so the remote call it made may still
    be running. When an uncertain hold applies (``hold`` seconds, else its names' ``uncertain_hold``) the slots
    stay held until it is over (the sweep then gives them back); the task's outcome is recorded now.
    """
    if uncertain and _hold_uncertain(conn, token, fence, outcome, hold=hold, now=now):
        final = _final_outcome(outcome, grouped=False)
        report = ReleaseReport(released=True)
        if final is not None and books.books_finish(
            conn, token.task_id, final, attempt=token.attempt, detail=detail, now=now
        ):
            report.finished.append((token.task_id, final))
        return report
    final = _final_outcome(outcome, grouped=False)
    # A lost run may have to go back in line from its stored message: the general path does that.
    row = (
        None
        if outcome is Outcome.WORKER_LOST
        else _release_fast(conn, token, fence, outcome, final, detail=detail, now=now)
    )
    if row is None:  # lost, a claim with a group, or nothing to release (stale fence, second call, reaped)
        removed = claims.claims_delete_fenced(conn, token, fence)
        if removed is None:
            return ReleaseReport(released=False)
        return _after_claim_removed(conn, removed, outcome, detail=detail, dispatch=dispatch, local=local, now=now)
    report = ReleaseReport(released=True, finished=[(token.task_id, final)] if row.recorded and final else [])
    if row.has_shadow:
        _shadows_follow(conn, token, row.key, outcome, now=now)
    waited = _rooms_with_waiters(conn, row)
    for key in sorted({k for k, _ in waited}):
        keys.keys_lock(conn, key, key_name(key), now=now)
    report.promotions += _promote_each_key(conn, waited, dispatch=dispatch, local=local, now=now)
    return report


def _rooms_with_waiters(conn: sa.Connection, row: Any) -> list[tuple[str, int]]:
    """The (key, shard) rows a fast release gave room on whose key has parked attempts (read after the slot
    rows' locks were taken: a new snapshot, D2), in lock order, once per free slot."""
    return [
        (key, shard)
        for key, shard, free in zip(row.room_keys, row.room_shards, row.room_free, strict=True)
        if conn.execute(KEYS_WAITING, {"key": key}).scalar()
        for _ in range(int(free))
    ]


def _promote_each_key(
    conn: sa.Connection,
    freed: list[tuple[str, int]],
    *,
    dispatch: float,
    local: LocalHandoff | None = None,
    now: Any = None,
) -> list[Promotion]:
    """Promote into free slots listed as (key, shard), one entry per free slot, key by key in lock order (the
    caller holds the rows). A slot left free earlier (a line that was not due yet) is filled too: a release
    fills its shard, not just the slot it gave back."""
    promotions: list[Promotion] = []
    for key in sorted({k for k, _ in freed}):
        shards = [sh for k, sh in freed if k == key]
        promotions += _promote_waiters(conn, key, shards, dispatch=dispatch, local=local, now=now)
        if promotions and local is not None:
            local = None  # a releaser runs at most one promotion itself; the others are dispatched
    return promotions


def _hold_uncertain(
    conn: sa.Connection, token: Token, fence: int, outcome: Outcome, *, hold: float | None, now: Any
) -> bool:
    conn.execute(LOCK_TASK, {"task_id": token.task_id})  # lock order: the task's row first
    return claims.claims_hold_uncertain(conn, token, fence, outcome.value, hold=hold, now=now)


def _release_fast(
    conn: sa.Connection, token: Token, fence: int, outcome: Outcome, final: str | None, *, detail: str, now: Any
) -> Any:
    params = {
        "task_id": token.task_id,
        "attempt": token.attempt,
        "fence": fence,
        "final": final,
        "over": outcome is not Outcome.WORKER_LOST,
        "detail": detail,
        "now": now,
    }
    return conn.execute(RELEASE_FAST, params).first()


def release_autocommit(
    conn: sa.Connection, token: Token, fence: int, outcome: Outcome, *, detail: str = "", now: Any = None
) -> tuple[ReleaseReport, Any] | None:
    """The release of a claim without a group as one self-committing statement (``conn`` in autocommit).
    Returns None when it released nothing (a grouped claim, or nothing to release: run ``release`` in a
    transaction), else the report and what is left to do: ``(key, shard, has_shadow)`` when the key may have waiters
    (read after the slot was given back, D2) or shadows — run ``after_release_autocommit`` for it."""
    if outcome is Outcome.WORKER_LOST:
        return None  # the general path: a lost run may go back in line from its stored message
    final = _final_outcome(outcome, grouped=False)
    row = _release_fast(conn, token, fence, outcome, final, detail=detail, now=now)
    if row is None:
        return None
    report = ReleaseReport(released=True, finished=[(token.task_id, final)] if row.recorded and final else [])
    waited = _rooms_with_waiters(conn, row)
    return report, ((waited, row.key, bool(row.has_shadow)) if waited or row.has_shadow else None)


def after_release_autocommit(
    conn: sa.Connection,
    token: Token,
    waited: list[tuple[str, int]],
    key: str | None,
    has_shadow: bool,
    outcome: Outcome,
    *,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    local: LocalHandoff | None = None,
    now: Any = None,
) -> list[Promotion]:
    """The rest of an autocommitted release, in a transaction: shadows follow their attempt (``key``: its first
    key), and each slot it gave back on a key with waiters (``waited``) goes to that key's next waiter (one
    release, one promotion per slot: a releaser that found several free slots would otherwise start several
    attempts at once). Locks the shard rows, then the key rows (lock order)."""
    uses = {
        (k, sh): conn.execute(slots.SLOTS_LOCK_ONE, {"key": k, "shard": sh, "name": key_name(k), "now": now}).first()
        for k, sh in sorted(set(waited))
    }
    for k in sorted({k for k, _ in waited} | ({key} if has_shadow and key is not None else set())):
        keys.keys_lock(conn, k, key_name(k), now=now)
    if has_shadow:
        _shadows_follow(conn, token, key, outcome, now=now)
    free = [(k, sh) for (k, sh), use in uses.items() if use is not None for _ in range(max(0, use.share - use.used))]
    return _promote_each_key(conn, free, dispatch=dispatch, local=local, now=now)


def _shadows_follow(conn: sa.Connection, token: Token, key: str | None, outcome: Outcome, *, now: Any) -> None:
    """Duplicates kept as shadows of an attempt follow its fate (D8): live again if its worker was lost (the
    copy will run), dropped otherwise."""
    params = {"task_id": token.task_id, "attempt": token.attempt}
    if outcome is Outcome.WORKER_LOST:
        conn.execute(waiting.WAITING_SHADOW_LIVE, params)
        return
    dropped = len(conn.execute(waiting.WAITING_SHADOW_DROP, params).all())
    if dropped and key is not None:
        keys.keys_remove_waiting(conn, key, dropped, now=now)


def _after_claim_removed(
    conn: sa.Connection,
    row: Any,
    outcome: Outcome,
    *,
    detail: str,
    dispatch: float,
    local: LocalHandoff | None = None,
    now: Any = None,
) -> ReleaseReport:
    """Book-keeping after a claim row was deleted by its owner or the reaper: the task's books (its row is
    locked first, lock order), the slot, the shadows (D8), the group's head, and the promotions."""
    token = Token(row.task_id, row.attempt)
    report = ReleaseReport(released=True)
    final = _final_outcome(outcome, grouped=row.group_key is not None)
    # The task's row first (lock order): an arrival of the same task holds it while it looks for this claim and
    # parks a duplicate as its shadow; taking it here means we see that shadow (or it sees the claim gone).
    conn.execute(LOCK_TASK, {"task_id": token.task_id})
    if final is not None:
        if books.books_finish(conn, token.task_id, final, attempt=token.attempt, detail=detail, now=now):
            report.finished.append((token.task_id, final))
    elif outcome is Outcome.RETRY:
        books.books_attempt_over(conn, token.task_id, token.attempt)

    freed = give_back(conn, claims.Holding.of(row), now=now)
    _shadows_follow(conn, token, row.key, outcome, now=now)
    # A promoted attempt whose run was lost: its broker message was acked when it was parked, so it goes back in
    # line, in its old place, from the stored message (a copy the broker still holds is a duplicate, D8).
    parked = getattr(row, "parked", None) if outcome is Outcome.WORKER_LOST else None
    line = None if parked is None else waiting.parked_line(parked)
    to_lock = {key for key, _ in freed} | ({line} if line is not None else set())
    for key in sorted(to_lock):
        keys.keys_lock(conn, key, key_name(key), now=now)
    if parked is not None and waiting.waiting_restore(conn, parked) and line is not None:
        keys.keys_add_waiting(conn, line, force=True)
    if row.group_key is not None and final is not None:
        groups.groups_lock(conn, row.group_key)
        groups.members_finish(conn, token.task_id)
        _unblock_head(conn, row.group_key)
    report.promotions += _promote_each_key(conn, freed, dispatch=dispatch, local=local, now=now)
    if row.group_key is not None:
        report.promotions += promote_group(conn, row.group_key, dispatch=dispatch, local=local, now=now)
    return report


def give_back(conn: sa.Connection, holding: claims.Holding, *, now: Any = None) -> list[tuple[str, int]]:
    """Give back every slot of a deleted claim, in lock order; the (key, shard) rows that now have room, once
    per free slot."""
    return [
        (key, shard)
        for key, shard in holding.slots()
        for _ in range(slots.slots_give_back(conn, key, shard, cost=holding.cost, now=now))
    ]


def release_early(
    conn: sa.Connection, token: Token, fence: int, *, dispatch: float = DEFAULT_DISPATCH_TIMEOUT, now: Any = None
) -> tuple[bool, list[Promotion]]:
    """Give back the concurrency slots of a running attempt before its outcome (``release_concurrency``): the
    claim row stays (books, fence, group) and the final release records the outcome as usual. Fenced like a
    release; (False, []) when there was nothing to give back."""
    conn.execute(LOCK_TASK, {"task_id": token.task_id})
    row = conn.execute(
        claims.CLAIMS_UNKEY, {"task_id": token.task_id, "attempt": token.attempt, "fence": fence}
    ).first()
    if row is None:
        return False, []
    freed = give_back(conn, claims.Holding.of(row), now=now)
    return True, promote_freed(conn, freed, dispatch=dispatch, now=now)


def give_back_reserved(conn: sa.Connection, row: Any, *, now: Any = None) -> list[tuple[str, int]]:
    """Give back the slots a deleted (or lapsed) waiting row had reserved; the (key, shard) rows with room."""
    if not getattr(row, "reserved_keys", None):
        return []
    pairs = sorted(zip(row.reserved_keys, row.reserved_shards, strict=True))
    return [
        (k, sh) for k, sh in pairs for _ in range(slots.slots_give_back(conn, k, sh, cost=int(row.cost or 1), now=now))
    ]


def promote_freed(
    conn: sa.Connection, freed: list[tuple[str, int]], *, dispatch: float = DEFAULT_DISPATCH_TIMEOUT, now: Any = None
) -> list[Promotion]:
    """Give slots given back outside a release to the next waiters of their keys (head rows locked in order)."""
    for key in sorted({k for k, _ in freed}):
        keys.keys_lock(conn, key, key_name(key), now=now)
    return _promote_each_key(conn, freed, dispatch=dispatch, now=now)


def _final_outcome(outcome: Outcome, *, grouped: bool) -> str | None:
    """The task's final outcome for an attempt outcome, or None when the task goes on (retry, worker lost).
    A group head's final failure is a dead-letter (D11): the group moves on."""
    if outcome in (Outcome.RETRY, Outcome.WORKER_LOST):
        return None
    if outcome is Outcome.FAILED and grouped:
        return "dead_lettered"
    return outcome.value


def promote_key(
    conn: sa.Connection, key: str, *, dispatch: float = DEFAULT_DISPATCH_TIMEOUT, now: Any = None
) -> list[Promotion]:
    """Give every free slot of ``key`` to its next promotable waiters (after an override, a limit raise, a
    reclaimed lease, a not-before time passing). Locks the key's shard rows, then its head row."""
    name = key_name(key)
    uses = slots.slots_lock_all(conn, key, name, now=now)
    free = [u.shard for u in uses for _ in range(max(0, u.share - u.used))]
    if not free:
        return []
    keys.keys_lock(conn, key, name, now=now)
    return _promote_waiters(conn, key, free, dispatch=dispatch, now=now)


def _promote_waiters(
    conn: sa.Connection,
    key: str,
    free_shards: list[int],
    *,
    dispatch: float,
    local: LocalHandoff | None = None,
    now: Any = None,
) -> list[Promotion]:
    """Promote waiters of ``key`` into ``free_shards`` (rows the caller holds locked; at most one promotion per
    entry), in order. The caller holds the key's head row too.

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
        if not progressed:
            break
    return promoted


#: ``_take_for``'s answer when the attempt moved to the line of a key it lacks.
_MOVED: Any = object()


def _take_for(conn: sa.Connection, cand: Any, key: str, shards: list[int], *, rated: bool, now: Any) -> Any:
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
    taken_now = [(key, shard)]
    missing: str | None = None
    for other in sorted(k for k in (cand.keys or ()) if k not in got):
        if _someone_ahead(conn, other, cand, now=now):
            missing = other
            break
        taken = slots.slots_take_nowait(conn, other, key_name(other), cost=cost, now=now)
        if taken is None:
            missing = other
            break
        got[other] = taken
        taken_now.append((other, taken))
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
    if conn.execute(KEYS_LOCK_NOWAIT, {"key": missing}).first() is None:
        return give_up()  # the missing key's head row is busy (or not there yet): the sweep moves or starts it
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
    if savepoint is not None:
        savepoint.commit()
    return _MOVED


#: ``_take_tokens``'s answer when a token bucket's row is busy (taken without waiting: out of lock order).
_BUSY: Any = object()

# names_rated: which of these names have a token bucket.
NAMES_RATED = sa.text("SELECT name FROM keyed_names WHERE name = ANY(:names) AND rate IS NOT NULL")


def _take_tokens(conn: sa.Connection, cand: Any, key: str, *, rated: bool, now: Any) -> Any:
    """Take the tokens a promotion needs from every rate-limited key of the candidate: None when taken (or none
    needed), else the time they will exist, or ``_BUSY`` when another key's bucket row is locked. The line
    key's row is held by the caller; other keys' rows are taken without waiting."""
    cost = int(cand.cost or 1)
    others = [k for k in (cand.keys or ()) if k != key]
    rated_names = (
        set(conn.execute(NAMES_RATED, {"names": sorted({key_name(k) for k in others})}).scalars()) if others else set()
    )
    buckets = ([key] if rated else []) + sorted(k for k in others if key_name(k) in rated_names)
    wait_until = None
    for k in buckets:
        if k != key and conn.execute(KEYS_LOCK_NOWAIT, {"key": k}).first() is None:
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


def _someone_ahead(conn: sa.Connection, key: str, cand: Any, *, now: Any) -> bool:
    params = {"key": key, "priority": cand.priority, "arrival": cand.arrival, "now": now}
    return bool(conn.execute(waiting.WAITING_AHEAD, params).scalar())


# keys_lock_nowait: the head row of a key for a step that holds locks later in the lock order.
KEYS_LOCK_NOWAIT = sa.text("SELECT waiting FROM keyed_keys WHERE key = :key FOR UPDATE SKIP LOCKED")


def promote_multi(
    conn: sa.Connection, token: Token, *, dispatch: float = DEFAULT_DISPATCH_TIMEOUT, now: Any = None
) -> list[Promotion]:
    """Promote one parked attempt with several keys if every key has room for it and it is first in every
    key's line — taking every lock in lock order, so it never has to skip a busy row (the sweep's backstop
    for multi-key waiters, D2)."""
    row = conn.execute(
        sa.text("SELECT keys FROM keyed_waiting WHERE task_id = :task_id AND attempt = :attempt AND NOT shadow"),
        {"task_id": token.task_id, "attempt": token.attempt},
    ).first()
    if row is None or not row.keys:
        return []
    all_keys = sorted(row.keys)
    uses = {k: slots.slots_lock_all(conn, k, key_name(k), now=now) for k in all_keys}
    for k in all_keys:
        keys.keys_lock(conn, k, key_name(k), now=now)
    cand = conn.execute(waiting.WAITING_GET_LOCKED, {"task_id": token.task_id, "attempt": token.attempt}).first()
    if cand is None or cand.not_before is not None or cand.group_blocked or _is_past(conn, cand.deadline, now):
        return []
    if cand.group_key is not None:
        groups.groups_lock(conn, cand.group_key)
        head, busy = groups.groups_head(conn, cand.group_key)
        if busy or head != cand.group_seq:
            return []
    cost = int(cand.cost or 1)
    rooms = dict(zip(cand.reserved_keys or (), cand.reserved_shards or (), strict=True))
    needed = [k for k in all_keys if k not in rooms]
    for k in needed:
        room = next((u.shard for u in uses[k] if u.fits(cost)), None)
        if room is None or _someone_ahead(conn, k, cand, now=now):
            return []
        rooms[k] = room
    savepoint = conn.begin_nested()
    for k in needed:
        if not slots.slots_take(conn, k, key_name(k), rooms[k], cost=cost, now=now):
            savepoint.rollback()
            return []
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
        return []
    savepoint.commit()
    holding = _holding(cand, rooms)
    promotion = _promote_row(
        conn, cand, key=holding.key, shard=holding.shard, holding=holding, dispatch=dispatch, now=now
    )
    keys.keys_remove_waiting(conn, cand.key, now=now)
    return [promotion]


def promote_group(
    conn: sa.Connection,
    group_key: str,
    *,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    local: LocalHandoff | None = None,
    now: Any = None,
) -> list[Promotion]:
    """Start the head of ``group_key`` if it is parked, due, and its group is free. A head that also needs a
    key slot takes one only if free without waiting (SKIP LOCKED: out of lock order); otherwise the key's
    own promotions pick it up, since it is no longer blocked by its group."""
    groups.groups_lock(conn, group_key)
    head, busy = groups.groups_head(conn, group_key)
    if busy or head is None:
        return []
    cand = waiting.waiting_group_member(conn, group_key, head)
    if cand is None or cand.not_before is not None or _is_past(conn, cand.deadline, now):
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


def _take_nowait_all(conn: sa.Connection, cand: Any, *, now: Any) -> claims.Holding | None:
    """Take every slot a locked waiting row needs without waiting for any lock (the caller holds locks later
    in the lock order), only where no one stands before it in line: all or none."""
    cost = int(cand.cost or 1)
    savepoint = conn.begin_nested()
    got = dict(zip(cand.reserved_keys or (), cand.reserved_shards or (), strict=True))
    ok = conn.execute(KEYS_LOCK_NOWAIT, {"key": cand.key}).first() is not None
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
    now: Any = None,
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


def revoke(
    conn: sa.Connection, task_id: str, *, dispatch: float = DEFAULT_DISPATCH_TIMEOUT, now: Any = None
) -> list[Promotion]:
    """Store a revoke in the ledger (Celery's in-memory revoke list expires, D11): parked attempts leave the
    waiting room with outcome ``revoked``; a promotion not yet bound is taken back (its slots go to the next
    waiters); a task between attempts (a retry in transit or waiting for its countdown in a worker) is booked
    revoked, so the attempt is dropped when it arrives; an unseen task id is recorded likewise. Running attempts
    are revoked by Celery and released by their worker with ``Outcome.REVOKED``. All under the task's row lock
    (first in the lock order), which every claim, park and release of the task takes too."""
    locked = conn.execute(
        sa.text("SELECT outcome, finished_attempt FROM keyed_tasks WHERE task_id = :task_id FOR UPDATE"),
        {"task_id": task_id},
    ).first()
    if locked is None:
        conn.execute(books.BOOKS_REVOKE_UNARRIVED, {"task_id": task_id, "now": now})
        return []
    if locked.outcome is not None:
        return []
    rows = conn.execute(waiting.WAITING_DELETE_TASK, {"task_id": task_id}).all()
    if not rows:
        held = conn.execute(CLAIMS_OF_TASK, {"task_id": task_id}).all()
        unbound = conn.execute(CLAIMS_DELETE_UNBOUND_OF_TASK, {"task_id": task_id}).all()
        if unbound:
            promotions: list[Promotion] = []
            for row in unbound:
                promotions += _after_claim_removed(
                    conn, row, Outcome.REVOKED, detail="revoked before it was picked up", dispatch=dispatch, now=now
                ).promotions
            return promotions
        if held:
            return []  # running (or its slots held after it ended): its worker releases it
        return _finish_never_ran(
            conn,
            Token(task_id, int(locked.finished_attempt) + 1),
            "revoked",
            detail="revoked between attempts",
            dispatch=dispatch,
            now=now,
        )
    freed = [fr for r in rows for fr in give_back_reserved(conn, r, now=now)]
    for r in rows:
        if r.key is not None:
            keys.keys_lock(conn, r.key, key_name(r.key), now=now)
            keys.keys_remove_waiting(conn, r.key, now=now)
    promotions = promote_freed(conn, freed, dispatch=dispatch, now=now)
    return promotions + _finish_never_ran(
        conn,
        Token(task_id, rows[0].attempt),
        "revoked",
        detail="revoked while waiting",
        dispatch=dispatch,
        now=now,
    )


# claims_of_task / claims_delete_unbound_of_task: a task's claims, and its promotions nobody bound yet (revoke).
CLAIMS_OF_TASK = sa.text("SELECT attempt, state FROM keyed_claims WHERE task_id = :task_id")
CLAIMS_DELETE_UNBOUND_OF_TASK = sa.text(
    """
    DELETE FROM keyed_claims WHERE task_id = :task_id AND state = 'promoted'
    RETURNING task_id, attempt, key, shard, group_key, fence, parked, cost, extra_keys, extra_shards
    """
)


def _finish_never_ran(
    conn: sa.Connection,
    token: Token,
    outcome: str,
    *,
    detail: str,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: Any = None,
) -> list[Promotion]:
    """Record the final outcome of a task that will not run; if it was a group member, the group moves on."""
    books.books_finish(conn, token.task_id, outcome, attempt=token.attempt, detail=detail, now=now)
    member = groups.members_get(conn, token.task_id)
    if member is None:
        return []
    groups.groups_lock(conn, member.group_key)
    groups.members_finish(conn, token.task_id)
    _unblock_head(conn, member.group_key)
    return promote_group(conn, member.group_key, dispatch=dispatch, now=now)


def settle(
    conn: sa.Connection,
    task_id: str,
    outcome: str,
    *,
    detail: str,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: Any = None,
) -> tuple[bool, list[Promotion]]:
    """Record the final ``outcome`` of a task that has no attempt in the ledger any more (its result says its
    body ended, but its release never committed: D15); its group moves on. (False, []) when the task is not
    open and idle any more (an attempt arrived meanwhile, or its outcome is recorded)."""
    conn.execute(LOCK_TASK, {"task_id": task_id})  # lock order: the task's row first, then look (D1)
    params = {"task_id": task_id, "outcome": outcome, "detail": detail, "now": now}
    row = conn.execute(books.BOOKS_SETTLE, params).first()
    if row is None:
        return False, []
    if row.group_key is None:
        return True, []
    groups.groups_lock(conn, row.group_key)
    groups.members_finish(conn, task_id)
    _unblock_head(conn, row.group_key)
    return True, promote_group(conn, row.group_key, dispatch=dispatch, now=now)


def _unblock_head(conn: sa.Connection, group_key: str) -> None:
    head, _ = groups.groups_head(conn, group_key)
    if head is not None:
        waiting.waiting_unblock(conn, group_key, head)


def _group_seq(conn: sa.Connection, arrival: Arrival, *, now: Any) -> int:
    """The arrival's number in its group: its existing membership (registered at publish, or a previous
    attempt), else a number allocated now (a producer that did not register: ordered by receipt, D10)."""
    assert arrival.group_key is not None
    member = groups.members_get(conn, arrival.task_id)
    if member is not None:
        if not member.received:
            conn.execute(groups.MEMBERS_MARK_RECEIVED, {"task_id": arrival.task_id})
        return int(member.seq)
    return groups.groups_register(conn, arrival.group_key, arrival.task_id, received=True, now=now)


def _duplicate(
    conn: sa.Connection, arrival: Arrival, kind: str, detail: str, *, name: str | None, now: Any
) -> Admission:
    """A known attempt token arrived again (D8): count it; a duplicate of a running attempt is kept as its
    shadow (promoted if that attempt's lease is reclaimed, dropped when it finishes)."""
    books.books_count_duplicate(conn, arrival.task_id)
    if kind == "claim" and detail in ("running", "uncertain"):
        if arrival.key and name:
            keys.keys_lock(conn, arrival.key, name, now=now)
        inserted = waiting.waiting_insert(
            conn,
            arrival,
            name=name,
            group_seq=None if not arrival.group_key else _member_seq(conn, arrival.task_id),
            shadow=True,
            now=now,
        )
        if inserted is not None and arrival.key:
            keys.keys_add_waiting(conn, arrival.key, force=True)
        return Admission(Verdict.DUPLICATE, detail="shadow of a running attempt")
    return Admission(Verdict.DUPLICATE, detail=f"already {detail}")


def _member_seq(conn: sa.Connection, task_id: str) -> int | None:
    member = groups.members_get(conn, task_id)
    return None if member is None else int(member.seq)


def _make_place(conn: sa.Connection, arrival: Arrival, line: str, *, now: Any) -> list[str] | None:
    """Count the arrival in its key's waiting room (max_waiting). Under the overflow policy 'supersede' a
    newer arrival first replaces the parked attempt with the same supersede key, and when the room is full,
    the oldest parked attempt of the lowest priority. Returns the replaced task ids, or None when there is no
    place. (The policy is only read when it can matter.) ``line``: the key whose waiting room it enters."""
    name = key_name(line)
    replaced: list[str] = []
    policy: str | None = None
    if arrival.supersede_key:
        policy = _overflow_policy(conn, name)
        if policy == "supersede":
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
    return conn.execute(
        sa.text("SELECT overflow FROM keyed_names WHERE name = :name"), {"name": name}
    ).scalar_one_or_none()


def _supersede(conn: sa.Connection, arrival: Arrival, line: str, rows: Sequence[Any], *, now: Any) -> list[str]:
    if rows:
        keys.keys_remove_waiting(conn, line, len(rows), now=now)
    for r in rows:
        _finish_never_ran(
            conn, Token(r.task_id, r.attempt), "superseded", detail=f"replaced by {arrival.task_id}", now=now
        )
    return [r.task_id for r in rows]


def _is_future(conn: sa.Connection, when: Any, now: Any) -> bool:
    return bool(
        conn.execute(sa.text(f"SELECT CAST(:when AS timestamptz) > {NOW}"), {"when": when, "now": now}).scalar_one()
    )


def _is_past(conn: sa.Connection, when: Any, now: Any) -> bool:
    if when is None:
        return False
    return bool(
        conn.execute(sa.text(f"SELECT CAST(:when AS timestamptz) <= {NOW}"), {"when": when, "now": now}).scalar_one()
    )
