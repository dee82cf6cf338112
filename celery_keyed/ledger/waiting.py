"""The waiting room: parked attempts with their full message (table ``keyed_waiting``).

Order per key (D10): priority (higher first), then arrival number (the ledger's order of receipt). A row is
*promotable* when it is not a shadow (D8), not before its ``not_before`` time (the sweep clears ``not_before``
when due, D2) and not blocked behind its group's head; the partial index ``keyed_waiting_ready_idx`` holds
exactly those rows, so a promotion never walks over rows that cannot start. Every insert and delete of a row
with a key changes ``keyed_keys.waiting`` in the same transaction (keys.py).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Protocol

import sqlalchemy as sa

from celery_keyed.ledger.attempts import Arrival, Token
from celery_keyed.ledger.clock import NOW


class WaitingRow(Protocol):
    """A ``keyed_waiting`` row as ``waiting_group_member`` returns it (``_COLUMNS``): the columns its callers read."""

    @property
    def task_id(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def key(self) -> str | None: ...
    @property
    def group_key(self) -> str | None: ...
    @property
    def group_seq(self) -> int | None: ...
    @property
    def priority(self) -> int: ...
    @property
    def arrival(self) -> int: ...
    @property
    def not_before(self) -> datetime | None: ...
    @property
    def deadline(self) -> datetime | None: ...
    @property
    def group_blocked(self) -> bool: ...
    @property
    def queue(self) -> str | None: ...
    @property
    def message(self) -> Any: ...
    @property
    def keys(self) -> list[str] | None: ...
    @property
    def cost(self) -> int: ...
    @property
    def reserved_keys(self) -> list[str] | None: ...
    @property
    def reserved_shards(self) -> list[int] | None: ...
    @property
    def fair_key(self) -> str | None: ...


class LineRow(WaitingRow, Protocol):
    """A waiting row read from the line of a key (``waiting_next_for_key``): its key is that key."""

    @property
    def key(self) -> str: ...


_COLUMNS = (
    "task_id, attempt, key, group_key, group_seq, priority, arrival, arrived_at, not_before, deadline, "
    "supersede_key, shadow, group_blocked, queue, message, keys, cost, reserved_keys, reserved_shards, reserved_at, "
    "fair_key, debounce_key, debounce_cap, fair_weight"
)

#: SQL: the debounce period and the burst's hard maximum as intervals (bind ``debounce``, ``debounce_max``, seconds).
_DEBOUNCE = "make_interval(secs => CAST(:debounce AS double precision))"
_DEBOUNCE_CAP = (
    f"COALESCE(CAST(:debounce_cap AS timestamptz),"
    f" {NOW} + make_interval(secs => CAST(:debounce_max AS double precision)))"
)

# waiting_insert: park an attempt. The latest start is the earlier of Celery's expires and arrival + max_wait.
# A debounced attempt (debounce_key set) is due after its quiet period, never after its burst's cap (the cap of the
# burst it replaced, or now + debounce_max for a new burst).
# ON CONFLICT: the token is parked already (a duplicate raced us) → no row.
WAITING_INSERT = sa.text(
    f"""
    INSERT INTO keyed_waiting ({_COLUMNS})
    VALUES (:task_id, :attempt, :key, :group_key, :group_seq, :priority, nextval('keyed_arrival_seq'), {NOW},
            CASE WHEN CAST(:debounce_key AS text) IS NOT NULL THEN LEAST({NOW} + {_DEBOUNCE}, {_DEBOUNCE_CAP})
                 WHEN CAST(:not_before AS timestamptz) > {NOW} THEN CAST(:not_before AS timestamptz) END,
            LEAST(CAST(:deadline AS timestamptz),
                  {NOW} + (SELECT make_interval(secs => c.max_wait) FROM keyed_names c WHERE c.name = :name)),
            :supersede_key, :shadow, :group_blocked, :queue, CAST(:message AS jsonb), CAST(:keys AS text[]), :cost,
            NULL, NULL, NULL, :fair_key,
            CAST(:debounce_key AS text),
            CASE WHEN CAST(:debounce_key AS text) IS NOT NULL THEN {_DEBOUNCE_CAP} END,
            CAST(:fair_weight AS double precision))
    ON CONFLICT (task_id, attempt) DO NOTHING
    RETURNING arrival
    """
)

# waiting_next_for_key: the next promotable attempts of a key, in order, skipping rows another transaction is
# promoting. Rows past their latest start are left to the sweep, which records them expired (D2, §3.6).
WAITING_NEXT_FOR_KEY = sa.text(
    f"""
    SELECT {_COLUMNS} FROM keyed_waiting
     WHERE key = :key AND NOT shadow AND not_before IS NULL AND NOT group_blocked
       AND (deadline IS NULL OR deadline > {NOW})
     ORDER BY priority DESC, arrival
     LIMIT :limit
       FOR UPDATE SKIP LOCKED
    """
)

# waiting_promotable_exists: SQL condition "the key has a promotable parked attempt" (a not-before time that
# passed counts, even before the sweep cleared it). An arrival never takes a free slot ahead of one (FIFO,
# D10): the room belongs to the head of the line, which the releaser (or the sweep) promotes.
PROMOTABLE_EXISTS = f"""EXISTS (
    SELECT 1 FROM keyed_waiting w
     WHERE w.key = :key AND NOT w.shadow AND (w.not_before IS NULL OR w.not_before <= {NOW})
       AND NOT w.group_blocked AND (w.deadline IS NULL OR w.deadline > {NOW}))"""
WAITING_PROMOTABLE_EXISTS = sa.text(f"SELECT {PROMOTABLE_EXISTS}")

# waiting_clear_due_for_key: rows of a key whose not-before time passed join the line before a promotion
# picks from it (their arrival number keeps their place; the sweep does the same for every key, D2). Also
# answers how the key's name orders its line (fair) and whether it has a token bucket (rated).
WAITING_CLEAR_DUE_FOR_KEY = sa.text(
    f"""
    WITH due AS (UPDATE keyed_waiting SET not_before = NULL WHERE key = :key AND not_before <= {NOW})
    SELECT COALESCE(c.fair, false) AS fair, COALESCE(c.rated, false) AS rated
      FROM (SELECT 1) one LEFT JOIN keyed_names c ON c.name = :name
    """
)

# waiting_next_fair: the next promotable attempts of a key of a fair name: the head of each fair key's own line,
# those whose fair key has the lowest load first — the slots it holds of the key divided by its weight
# (keyed_fair_weight: override, else the head's call weight, else the name's table, else 1) — then
# by priority and arrival. With weights all 1 this is round-robin by slots held; promote.promote_waiters takes one
# row per reading, so every promotion sees the loads the previous one left.
WAITING_NEXT_FAIR = sa.text(
    f"""
    WITH heads AS (
        SELECT DISTINCT ON (fair_key) task_id, attempt, fair_key, fair_weight, priority, arrival FROM keyed_waiting
         WHERE key = :key AND NOT shadow AND not_before IS NULL AND NOT group_blocked
           AND (deadline IS NULL OR deadline > {NOW})
         ORDER BY fair_key, priority DESC, arrival
    ), ranked AS (
        SELECT h.task_id, h.attempt, h.priority, h.arrival,
               (SELECT COALESCE(sum(c.cost), 0) FROM keyed_claims c
                 WHERE (c.key = :key OR c.extra_keys @> ARRAY[CAST(:key AS text)])
                   AND c.fair_key IS NOT DISTINCT FROM h.fair_key)
               / keyed_fair_weight(split_part(:key, ':', 1), h.fair_key, h.fair_weight, {NOW}) AS load
          FROM heads h ORDER BY load, h.priority DESC, h.arrival LIMIT :limit
    )
    SELECT {", ".join("w." + c.strip() for c in _COLUMNS.split(","))}
      FROM keyed_waiting w JOIN ranked r ON r.task_id = w.task_id AND r.attempt = w.attempt
     ORDER BY r.load, r.priority DESC, r.arrival
       FOR UPDATE OF w SKIP LOCKED
    """
)

# waiting_not_before: a parked attempt waits for its token (rate limit): not promotable before then.
WAITING_NOT_BEFORE = sa.text(
    "UPDATE keyed_waiting SET not_before = :not_before WHERE task_id = :task_id AND attempt = :attempt"
)

# waiting_group_member: the parked (non-shadow) row of a group member, locked, if it is not being promoted.
WAITING_GROUP_MEMBER = sa.text(
    f"""
    SELECT {_COLUMNS} FROM keyed_waiting
     WHERE group_key = :group_key AND group_seq = :seq AND NOT shadow
       FOR UPDATE SKIP LOCKED
    """
)

# waiting_take: remove a row that is being promoted; the whole row comes back as JSON so an unbound
# promotion can be put back in its place (claims.parked).
WAITING_TAKE = sa.text(
    """
    DELETE FROM keyed_waiting w WHERE w.task_id = :task_id AND w.attempt = :attempt AND NOT w.shadow
    RETURNING to_jsonb(w.*) AS parked
    """
)

# waiting_restore: put a voided promotion back where it was (same arrival number). Without its reservations:
# the claim took them over, and whoever removed the claim gave them back.
WAITING_RESTORE = sa.text(
    f"""
    INSERT INTO keyed_waiting ({_COLUMNS})
    SELECT {_COLUMNS.replace("reserved_keys, reserved_shards, reserved_at", "NULL, NULL, NULL")}
      FROM jsonb_populate_record(NULL::keyed_waiting, CAST(:parked AS jsonb))
    ON CONFLICT (task_id, attempt) DO NOTHING
    RETURNING key
    """
)

# waiting_unblock_group_head: the group's head moved to this member; it may now be promoted by its key — unless its
# group is held for an operator (then it stays blocked until the group is resumed).
WAITING_UNBLOCK = sa.text(
    """
    UPDATE keyed_waiting SET group_blocked = false
     WHERE group_key = :group_key AND group_seq = :seq
       AND NOT EXISTS (SELECT 1 FROM keyed_groups g WHERE g.group_key = :group_key AND g.held_since IS NOT NULL)
    """
)

# waiting_delete_superseded: remove the parked attempts of a key with this supersede key (never shadows).
WAITING_DELETE_SUPERSEDED = sa.text(
    """
    DELETE FROM keyed_waiting
     WHERE key = :key AND supersede_key = :supersede_key AND NOT shadow AND reserved_keys IS NULL
    RETURNING task_id, attempt, group_key, message
    """
)

# waiting_debounce_replace: debounce, keep last: remove the open burst of a key and debounce key —
# its waiting debounced row whose due time has not come (a due row is closed: it waits for a slot and absorbs no
# arrival) — and answer its cap, which the replacing arrival inherits (the hard maximum counts from the burst's
# first arrival). Run under the key's head row lock (keys_lock), which every arrival of the key takes first, so two
# arrivals of one burst are decided one after the other: one row survives. SKIP LOCKED: a row another transaction
# holds (the sweep making it due, a revoke, an expiry) is leaving the open burst; the arrival starts a new one.
WAITING_DEBOUNCE_REPLACE = sa.text(
    f"""
    DELETE FROM keyed_waiting w USING (
        SELECT task_id, attempt FROM keyed_waiting
         WHERE key = :key AND debounce_key = :debounce_key AND NOT shadow AND not_before > {NOW}
           FOR UPDATE SKIP LOCKED) v
     WHERE w.task_id = v.task_id AND w.attempt = v.attempt
    RETURNING w.task_id, w.attempt, w.group_key, w.debounce_cap, w.message
    """
)

# waiting_debounce_extend: debounce, keep first: the open burst of a key and debounce key (as above) keeps its row
# and its arguments; the new arrival moves its due time to the end of a new quiet period, never past its cap. The
# caller records the arrival itself superseded. No row: no open burst (the arrival opens one).
WAITING_DEBOUNCE_EXTEND = sa.text(
    f"""
    UPDATE keyed_waiting w SET not_before = LEAST({NOW} + {_DEBOUNCE}, w.debounce_cap) FROM (
        SELECT task_id, attempt FROM keyed_waiting
         WHERE key = :key AND debounce_key = :debounce_key AND NOT shadow AND not_before > {NOW}
         ORDER BY arrival LIMIT 1 FOR UPDATE SKIP LOCKED) v
     WHERE w.task_id = v.task_id AND w.attempt = v.attempt
    RETURNING w.task_id, w.not_before, w.debounce_cap
    """
)

# waiting_delete_oldest: make a place in a full room under the 'supersede' policy: the oldest parked attempt
# of the lowest priority (its work is the stalest).
WAITING_DELETE_OLDEST = sa.text(
    """
    DELETE FROM keyed_waiting w USING (
        SELECT task_id, attempt FROM keyed_waiting
         WHERE key = :key AND NOT shadow AND reserved_keys IS NULL
         ORDER BY priority, arrival LIMIT 1 FOR UPDATE SKIP LOCKED) v
     WHERE w.task_id = v.task_id AND w.attempt = v.attempt
    RETURNING w.task_id, w.attempt, w.group_key, w.message
    """
)

# waiting_delete_expired: parked attempts past their latest start (the sweep records them expired).
WAITING_DELETE_EXPIRED = sa.text(
    f"""
    DELETE FROM keyed_waiting w USING (
        SELECT task_id, attempt FROM keyed_waiting
         WHERE deadline <= {NOW} ORDER BY deadline LIMIT :batch FOR UPDATE SKIP LOCKED) v
     WHERE w.task_id = v.task_id AND w.attempt = v.attempt
    RETURNING w.task_id, w.attempt, w.key, w.group_key, w.shadow, w.cost, w.reserved_keys, w.reserved_shards,
              w.message
    """
)

# waiting_clear_due: not-before times that passed make their rows promotable (the sweep then promotes).
WAITING_CLEAR_DUE = sa.text(
    f"""
    UPDATE keyed_waiting w SET not_before = NULL FROM (
        SELECT task_id, attempt FROM keyed_waiting
         WHERE not_before <= {NOW} ORDER BY not_before LIMIT :batch FOR UPDATE SKIP LOCKED) v
     WHERE w.task_id = v.task_id AND w.attempt = v.attempt
    RETURNING w.key, w.group_key
    """
)

# waiting_delete_task: the parked rows of a task id (revoke). Never a shadow: a shadow's attempt is running,
# and a running attempt is revoked by Celery and released by its worker.
WAITING_DELETE_TASK = sa.text(
    "DELETE FROM keyed_waiting WHERE task_id = :task_id AND NOT shadow"
    " RETURNING task_id, attempt, key, group_key, shadow, cost, reserved_keys, reserved_shards, message"
)

# waiting_shadow_drop / waiting_shadow_live: a live claim's duplicate follows the claim's fate (D8).
WAITING_SHADOW_DROP = sa.text(
    "DELETE FROM keyed_waiting WHERE task_id = :task_id AND attempt = :attempt AND shadow RETURNING key"
)
WAITING_SHADOW_LIVE = sa.text(
    """
    UPDATE keyed_waiting SET shadow = false
     WHERE task_id = :task_id AND attempt = :attempt AND shadow
    RETURNING key, group_key
    """
)
# waiting_shadow_keys: the lines of a claim's shadows (a lost run's shadows go live: new eligibility there, D2).
WAITING_SHADOW_KEYS = sa.text(
    "SELECT DISTINCT key FROM keyed_waiting WHERE task_id = :task_id AND attempt = :attempt AND shadow"
    " AND key IS NOT NULL"
)

# waiting_orphan_shadows: shadows whose attempt holds no claim any more (its release raced the duplicate's
# arrival): the sweep drops them if the attempt is over, else makes them live (D8 backstop).
WAITING_ORPHAN_SHADOWS = sa.text(
    """
    SELECT w.task_id, w.attempt, w.key FROM keyed_waiting w
     WHERE w.shadow AND NOT EXISTS (
           SELECT 1 FROM keyed_claims c WHERE c.task_id = w.task_id AND c.attempt = w.attempt)
     LIMIT :batch
    """
)

# waiting_count_by_key: parked rows of a key (reconcile compares it with keyed_keys.waiting).
WAITING_COUNT = sa.text("SELECT count(*) FROM keyed_waiting WHERE key = :key")

# waiting_keys_promotable: keys that have a promotable row and room for one more (the sweep promotes each, the D2
# backstop). The distinct keys come from keyed_waiting_ready_idx one index probe per key (a loose index scan: the
# recursive part jumps to the next key), not from every parked row; a key with no shard below its share (K reached,
# paused: a limit of 0) is left out, as no waiter of it can start — 9,002 of 9,002 keys in the 1,000,000-row run,
# each one a promotion transaction per sweep. A key without slot rows yet is kept: its promotion creates them.
WAITING_KEYS_PROMOTABLE = sa.text(
    f"""
    WITH RECURSIVE ks(key) AS (
        (SELECT w.key FROM keyed_waiting w
          WHERE w.key IS NOT NULL AND NOT w.shadow AND w.not_before IS NULL AND NOT w.group_blocked
          ORDER BY w.key LIMIT 1)
        UNION ALL
        SELECT (SELECT w.key FROM keyed_waiting w
                 WHERE w.key > ks.key AND NOT w.shadow AND w.not_before IS NULL AND NOT w.group_blocked
                 ORDER BY w.key LIMIT 1)
          FROM ks WHERE ks.key IS NOT NULL
    )
    SELECT ks.key FROM ks
     WHERE ks.key IS NOT NULL
       AND (EXISTS (SELECT 1 FROM keyed_slots s
                     WHERE s.key = ks.key
                       AND s.used + 1 <= keyed_row_share(s.key, {NOW}, s.shards, keyed_name_shards(s.name), s.shard))
            OR NOT EXISTS (SELECT 1 FROM keyed_slots s WHERE s.key = ks.key))
       AND EXISTS (SELECT 1 FROM keyed_waiting w
                    WHERE w.key = ks.key AND NOT w.shadow AND w.not_before IS NULL AND NOT w.group_blocked
                      AND (w.deadline IS NULL OR w.deadline > {NOW}))
     LIMIT :limit
    """
)
# waiting_multi_promotable: promotable attempts with several keys, oldest first (the sweep promotes each
# with its keys locked in lock order, so a lock-order skip never strands one, D2).
WAITING_MULTI_PROMOTABLE = sa.text(
    f"""
    SELECT task_id, attempt FROM keyed_waiting
     WHERE keys IS NOT NULL AND NOT shadow AND not_before IS NULL AND NOT group_blocked
       AND (deadline IS NULL OR deadline > {NOW})
     ORDER BY priority DESC, arrival
     LIMIT :limit
    """
)

# waiting_keys_of_token: the keys of a parked attempt (the sweep's multi-key promotion locks them in lock order
# before it locks the row itself).
WAITING_KEYS_OF_TOKEN = sa.text(
    "SELECT keys FROM keyed_waiting WHERE task_id = :task_id AND attempt = :attempt AND NOT shadow"
)

# waiting_get_locked: one parked row, locked, unless another transaction is promoting it.
WAITING_GET_LOCKED = sa.text(
    f"""
    SELECT {_COLUMNS} FROM keyed_waiting
     WHERE task_id = :task_id AND attempt = :attempt AND NOT shadow
       FOR UPDATE SKIP LOCKED
    """
)

# waiting_ahead: whether any promotable attempt stands before (priority, arrival) in the key's line.
WAITING_AHEAD = sa.text(
    f"""
    SELECT EXISTS (
        SELECT 1 FROM keyed_waiting w
         WHERE w.key = :key AND NOT w.shadow AND w.not_before IS NULL
           AND NOT w.group_blocked AND (w.deadline IS NULL OR w.deadline > {NOW})
           AND (w.priority > :priority OR (w.priority = :priority AND w.arrival < :arrival)))
    """
)

WAITING_GROUPS_PROMOTABLE = sa.text(
    f"""
    SELECT DISTINCT group_key FROM keyed_waiting
     WHERE group_key IS NOT NULL AND NOT shadow AND not_before IS NULL AND NOT group_blocked
       AND (deadline IS NULL OR deadline > {NOW})
     LIMIT :limit
    """
)


def waiting_insert(
    conn: sa.Connection,
    arrival: Arrival,
    *,
    name: str | None,
    group_seq: int | None,
    shadow: bool = False,
    group_blocked: bool = False,
    line: str | None = None,
    debounce_cap: Any = None,
    now: datetime | None = None,
) -> int | None:
    """Park ``arrival`` in the line of ``line`` (default: its first key); its arrival number, or None when
    the token is already parked. A debounced arrival is due after its quiet period, at most at ``debounce_cap``
    (the cap of the burst it replaces; None: a new burst, capped at now + ``arrival.debounce_max``)."""
    params = {
        "task_id": arrival.task_id,
        "attempt": arrival.attempt,
        "key": line or arrival.key,
        "group_key": arrival.group_key,
        "group_seq": group_seq,
        "priority": arrival.priority,
        "not_before": arrival.not_before,
        "deadline": arrival.deadline,
        "name": name,
        "supersede_key": arrival.supersede_key,
        "shadow": shadow,
        "group_blocked": group_blocked,
        "queue": arrival.queue,
        "message": json.dumps(arrival.message),
        "keys": list(arrival.keys) if arrival.extra_keys else None,
        "cost": arrival.cost,
        "fair_key": arrival.fair_key,
        "fair_weight": arrival.fair_weight,
        "debounce_key": None if shadow else arrival.debounce_key,
        "debounce": arrival.debounce,
        "debounce_max": arrival.debounce_max,
        "debounce_cap": debounce_cap,
        "now": now,
    }
    return conn.execute(WAITING_INSERT, params).scalar_one_or_none()


def waiting_next_for_key(
    conn: sa.Connection, key: str, *, limit: int = 4, fair: bool = False, now: datetime | None = None
) -> list[LineRow]:
    statement = WAITING_NEXT_FAIR if fair else WAITING_NEXT_FOR_KEY
    return list(conn.execute(statement, {"key": key, "limit": limit, "now": now}))


def waiting_group_member(conn: sa.Connection, group_key: str, seq: int) -> WaitingRow | None:
    return conn.execute(WAITING_GROUP_MEMBER, {"group_key": group_key, "seq": seq}).first()


def waiting_take(conn: sa.Connection, token: Token) -> str | None:
    """Remove a row being promoted; the row as JSON text, or None if it is gone."""
    parked = conn.execute(WAITING_TAKE, {"task_id": token.task_id, "attempt": token.attempt}).scalar_one_or_none()
    return None if parked is None else json.dumps(parked)


def waiting_restore(conn: sa.Connection, parked: Any) -> bool:
    """Put a stored waiting row back; False when it is there already. The caller counts it in the waiting room
    of ``parked_line(parked)`` (the line it stood in: for an attempt with several keys, not always its first)."""
    text = parked if isinstance(parked, str) else json.dumps(parked)
    return conn.execute(WAITING_RESTORE, {"parked": text}).first() is not None


def parked_line(parked: Any) -> str | None:
    """The key whose line a stored waiting row stood in."""
    row = json.loads(parked) if isinstance(parked, str) else parked
    return None if row is None else row.get("key")


def waiting_unblock(conn: sa.Connection, group_key: str, seq: int) -> None:
    conn.execute(WAITING_UNBLOCK, {"group_key": group_key, "seq": seq})


# waiting_move: an attempt with several keys moves to the line of the key it now lacks, keeping its arrival
# number (its place in every line), with the slots it reserves meanwhile (keys listed before that one).
WAITING_MOVE = sa.text(
    f"""
    UPDATE keyed_waiting
       SET key = :to_key, reserved_keys = CAST(:reserved_keys AS text[]),
           reserved_shards = CAST(:reserved_shards AS integer[]),
           reserved_at = CASE WHEN CAST(:reserved_keys AS text[]) IS NULL THEN NULL
                              ELSE COALESCE(reserved_at, {NOW}) END
     WHERE task_id = :task_id AND attempt = :attempt
    """
)

# waiting_reservations_lapsed: reservations held longer than the timeout are given back (a waiter listing
# shared keys in another order than others could otherwise hold what they need while they hold what it needs).
WAITING_RESERVATIONS_LAPSED = sa.text(
    f"""
    UPDATE keyed_waiting w SET reserved_keys = NULL, reserved_shards = NULL, reserved_at = NULL
      FROM (SELECT task_id, attempt, reserved_keys, reserved_shards FROM keyed_waiting
             WHERE reserved_at <= {NOW} - make_interval(secs => :timeout)
             ORDER BY reserved_at LIMIT :batch FOR UPDATE SKIP LOCKED) v
     WHERE w.task_id = v.task_id AND w.attempt = v.attempt
    RETURNING w.task_id, w.cost, v.reserved_keys, v.reserved_shards
    """
)


# waiting_to_head: newest wins (on_newer='cancel_running'): a newest that parked while it asked the attempt holding
# its slot to stop takes the head of its key's line (among waiters of its priority), so the slot the cancelled attempt
# frees goes to it rather than to the calls queued behind that attempt. Run under the key's head row lock (admit).
WAITING_TO_HEAD = sa.text(
    """
    UPDATE keyed_waiting w SET arrival = h.first - 1
      FROM (SELECT min(o.arrival) AS first FROM keyed_waiting o, keyed_waiting me
             WHERE me.task_id = :task_id AND me.attempt = :attempt
               AND o.key = me.key AND o.priority = me.priority) h
     WHERE w.task_id = :task_id AND w.attempt = :attempt AND h.first < w.arrival
    """
)
