"""Claims: the right of one attempt to execute (table ``keyed_claims``).

A claim row *is* a held slot: of (key, shard) when ``key`` is set, of its group when ``group_key`` is set.
Release exactly once: only the actor whose DELETE returns the row gives the slot back. The worker's release
(fenced by token + fence) and the reaper's reclaim (by expired lease) race for that row; the loser gets no row
and does nothing — so a stale worker can never free or complete its replacement's slot (DESIGN §3.4).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import sqlalchemy as sa

from celery_keyed.ledger.attempts import Token
from celery_keyed.ledger.clock import NOW


class ClaimRow(Protocol):
    """A ``keyed_claims`` row as ``claims_delete_fenced`` returns it: the columns its callers read."""

    @property
    def task_id(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def key(self) -> str | None: ...
    @property
    def shard(self) -> int | None: ...
    @property
    def group_key(self) -> str | None: ...
    @property
    def parked(self) -> Any: ...
    @property
    def cost(self) -> int: ...
    @property
    def extra_keys(self) -> list[str] | None: ...
    @property
    def extra_shards(self) -> list[int] | None: ...


# claims_insert_running: a slot taken by the caller's statement(s) becomes this attempt's claim.
CLAIMS_INSERT_RUNNING = sa.text(
    f"""
    INSERT INTO keyed_claims (task_id, attempt, key, shard, group_key, state, fence, holder,
                              lease_expires_at, claimed_at, parked, cost, extra_keys, extra_shards, fair_key,
                              supersede_key)
    VALUES (:task_id, :attempt, :key, :shard, :group_key, 'running', nextval('keyed_fence_seq'), :holder,
            {NOW} + make_interval(secs => :lease), {NOW}, CAST(:parked AS jsonb), :cost,
            CAST(:extra_keys AS text[]), CAST(:extra_shards AS integer[]), :fair_key, :supersede_key)
    RETURNING fence
    """
)

# claims_insert_promoted: a slot given to a parked attempt; bound later by its nonce (D5).
CLAIMS_INSERT_PROMOTED = sa.text(
    f"""
    INSERT INTO keyed_claims (task_id, attempt, key, shard, group_key, state, fence, nonce, dispatch_deadline,
                              lease_expires_at, claimed_at, parked, cost, extra_keys, extra_shards, fair_key)
    VALUES (:task_id, :attempt, :key, :shard, :group_key, 'promoted', nextval('keyed_fence_seq'), :nonce,
            {NOW} + make_interval(secs => :dispatch), {NOW} + make_interval(secs => :dispatch), {NOW},
            CAST(:parked AS jsonb), :cost, CAST(:extra_keys AS text[]), CAST(:extra_shards AS integer[]), :fair_key)
    RETURNING fence
    """
)

# claims_bind_promoted: the receiver of a promoted attempt binds it. Token, nonce and state must all match;
# no row = not a valid promotion (copied, forged, voided or already bound) → ordinary admission (D5).
# ``parked`` is kept: the attempt's broker message was acked when it was parked, so if this run is lost (worker
# lost, lease reclaimed) the attempt goes back in line from it instead of being lost (duplicates of it that the
# broker still holds are recognised by their token, D8).
CLAIMS_BIND_PROMOTED = sa.text(
    f"""
    UPDATE keyed_claims SET state = 'running', holder = :holder, nonce = NULL, dispatch_deadline = NULL,
           lease_expires_at = {NOW} + make_interval(secs => :lease)
     WHERE task_id = :task_id AND attempt = :attempt AND nonce = :nonce AND state = 'promoted'
    RETURNING fence
    """
)

# claims_delete_fenced: release. Only the attempt that holds this exact fence gives the slot back.
CLAIMS_DELETE_FENCED = sa.text(
    """
    DELETE FROM keyed_claims
     WHERE task_id = :task_id AND attempt = :attempt AND fence = :fence AND state = 'running'
    RETURNING task_id, attempt, key, shard, group_key, fence, parked, cost, extra_keys, extra_shards
    """
)

# claims_hold_uncertain: an attempt that ended by a hard time limit or a lost worker keeps its slots for the
# uncertain hold (the task's own, else the longest of its keys' names), because the remote call it made may
# still be running (DESIGN §7.4). Same guard as a release: only the holder of this exact fence. No row = no
# hold configured, or nothing to hold (then release as usual).
CLAIMS_HOLD_UNCERTAIN = sa.text(
    f"""
    UPDATE keyed_claims c
       SET state = 'uncertain', held_outcome = :outcome,
           lease_expires_at = {NOW} + make_interval(secs => h.secs)
      FROM (SELECT COALESCE(CAST(:hold AS double precision), (
                SELECT max(n.uncertain_hold) FROM keyed_names n, keyed_claims k
                 WHERE k.task_id = :task_id AND k.attempt = :attempt
                   AND n.name = ANY(array_prepend(split_part(k.key, ':', 1),
                       ARRAY(SELECT split_part(x, ':', 1) FROM unnest(k.extra_keys) AS x))))) AS secs) h
     WHERE c.task_id = :task_id AND c.attempt = :attempt AND c.fence = :fence AND c.state = 'running'
       AND c.key IS NOT NULL AND h.secs > 0
    RETURNING c.lease_expires_at
    """
)

# claims_delete_uncertain_due: uncertain holds whose time is up; the sweep gives their slots back.
CLAIMS_DELETE_UNCERTAIN_DUE = sa.text(
    f"""
    DELETE FROM keyed_claims c
     WHERE (c.task_id, c.attempt) IN (
            SELECT task_id, attempt FROM keyed_claims
             WHERE state = 'uncertain' AND lease_expires_at <= {NOW}
             ORDER BY lease_expires_at LIMIT :batch FOR UPDATE SKIP LOCKED)
    RETURNING c.task_id, c.attempt, c.key, c.shard, c.group_key, c.fence, c.parked, c.cost, c.extra_keys,
              c.extra_shards, c.held_outcome
    """
)

# claims_renew: the heartbeat renews exactly the attempts this process tracks (D6), never "all of a host".
# Returned rows are the attempts still held; a tracked attempt missing from the answer has lost its slot.
CLAIMS_RENEW = sa.text(
    f"""
    UPDATE keyed_claims c SET lease_expires_at = {NOW} + make_interval(secs => :lease)
      FROM unnest(CAST(:task_ids AS text[]), CAST(:attempts AS integer[]), CAST(:fences AS bigint[]))
           AS t(task_id, attempt, fence)
     WHERE c.task_id = t.task_id AND c.attempt = t.attempt AND c.fence = t.fence
       AND c.holder = :holder AND c.state = 'running'
    RETURNING c.task_id, c.attempt, c.fence
    """
)

# claims_request_cancel: newest wins (on_newer='cancel_running'). An arrival asks for the cancellation of the attempts
# of its first key and supersede key that hold a slot (running, or promoted and not bound yet: the supersede key of a
# promotion is in its stored waiting row) of tasks that arrived before its own (a retry of an older task never
# cancels a newer one). Runs in the arrival's transaction, after its task row and before the key's slot rows (a
# release locks the claim row, then the task row, then the slots: no cycle), so the request commits with the
# arrival's park or claim, or not at all; it waits for a release of the row in progress, and a claim that already
# ended has no row and is not cancelled. Set once (the first request's time and detail are kept); every matching
# row is returned, so a repeated arrival tells the holder again.
CLAIMS_REQUEST_CANCEL = sa.text(
    f"""
    UPDATE keyed_claims
       SET cancel_requested_at = COALESCE(cancel_requested_at, {NOW}),
           cancel_detail = COALESCE(cancel_detail, :detail)
     WHERE key = :key AND task_id <> :task_id AND state IN ('running', 'promoted')
       AND COALESCE(supersede_key, parked ->> 'supersede_key') = :supersede_key
       AND (SELECT arrived_at FROM keyed_tasks WHERE task_id = keyed_claims.task_id)
           <= (SELECT arrived_at FROM keyed_tasks WHERE task_id = :task_id)
    RETURNING task_id, attempt, holder
    """
)

# claims_withdraw_cancel: an arrival refused after all takes back the request it made (its own detail only).
CLAIMS_WITHDRAW_CANCEL = sa.text(
    """
    UPDATE keyed_claims SET cancel_requested_at = NULL, cancel_detail = NULL
     WHERE task_id = :task_id AND attempt = :attempt AND cancel_detail = :detail
    """
)

# claims_cancel_requested: of the claims a holder renews, those whose cancellation a newer arrival asked for.
CLAIMS_CANCEL_REQUESTED = sa.text(
    """
    SELECT c.task_id, c.attempt, c.fence, c.cancel_detail
      FROM keyed_claims c
      JOIN unnest(CAST(:task_ids AS text[]), CAST(:attempts AS integer[]), CAST(:fences AS bigint[]))
           AS t(task_id, attempt, fence)
        ON c.task_id = t.task_id AND c.attempt = t.attempt AND c.fence = t.fence
     WHERE c.holder = :holder AND c.cancel_requested_at IS NOT NULL
    """
)

# claims_get_fenced: the claim held with this fence, and whether its holder still renews its lease (a forced
# release by an operator of a live holder is a recorded breach of the bound, §3.1).
CLAIMS_GET_FENCED = sa.text(
    f"""
    SELECT task_id, attempt, key, group_key, state, fence, holder, lease_expires_at > {NOW} AS live
      FROM keyed_claims WHERE task_id = :task_id AND attempt = :attempt AND fence = :fence
    """
)


# claims_token_state: what the ledger holds for an attempt token (D8): a claim (running / promoted / uncertain) or a
# parked row (a shadow or not). Read under the task's row lock, so a concurrent delivery cannot slip between.
CLAIMS_TOKEN_STATE = sa.text(
    """
    SELECT 'claim' AS kind, state AS detail FROM keyed_claims WHERE task_id = :task_id AND attempt = :attempt
    UNION ALL
    SELECT 'waiting', CASE WHEN shadow THEN 'shadow' ELSE 'parked' END
      FROM keyed_waiting WHERE task_id = :task_id AND attempt = :attempt
    """
)

# claims_of_task / claims_delete_unbound_of_task: a task's claims, and its promotions nobody bound yet (revoke takes
# those back: an unbound promotion has not started, so its slots go to the next waiters, D5/D11).
CLAIMS_OF_TASK = sa.text("SELECT attempt, state FROM keyed_claims WHERE task_id = :task_id")
CLAIMS_DELETE_UNBOUND_OF_TASK = sa.text(
    """
    DELETE FROM keyed_claims WHERE task_id = :task_id AND state = 'promoted'
    RETURNING task_id, attempt, key, shard, group_key, fence, parked, cost, extra_keys, extra_shards
    """
)

# claims_expired_candidates: running claims whose lease expired, provided the database server itself has been up
# for a full lease (D7: a Postgres restart must not mass-reclaim the slots of tasks that kept running), and not while
# a failover holds new starts, nor for a lease after (D20: running attempts renew or re-assert their claims on the new
# server first, and releases lost with the old one are given again).
CLAIMS_EXPIRED_CANDIDATES = sa.text(
    f"""
    SELECT task_id, attempt, fence FROM keyed_claims
     WHERE state = 'running' AND lease_expires_at < {NOW}
       AND pg_postmaster_start_time() <= {NOW} - make_interval(secs => :lease)
       AND NOT keyed_failover_reaper_waits()
     ORDER BY lease_expires_at LIMIT :batch
    """
)
# claims_delete_expired_one: the reaper's side of the race for one claim row (release exactly once, D7); no row =
# the worker won (it released or renewed).
CLAIMS_DELETE_EXPIRED_ONE = sa.text(
    f"""
    DELETE FROM keyed_claims
     WHERE task_id = :task_id AND attempt = :attempt AND fence = :fence
       AND state = 'running' AND lease_expires_at < {NOW}
    RETURNING task_id, attempt, key, shard, group_key, fence, holder, parked, cost, extra_keys, extra_shards
    """
)
# claims_of_gone_holders / claims_delete_of_gone_holder: the running claims of holders known to be dead (their
# machine is ours and none of their processes exists: no body of theirs can run), given back at once instead of
# after the lease. The DELETE is guarded by holder and fence: a claim renewed or released meanwhile is left.
CLAIMS_OF_GONE_HOLDERS = sa.text(
    """
    SELECT task_id, attempt, fence FROM keyed_claims
     WHERE holder = ANY(CAST(:holders AS text[])) AND state = 'running' LIMIT :batch
    """
)
CLAIMS_DELETE_OF_GONE_HOLDER = sa.text(
    """
    DELETE FROM keyed_claims
     WHERE task_id = :task_id AND attempt = :attempt AND fence = :fence AND state = 'running'
       AND holder = ANY(CAST(:holders AS text[]))
    RETURNING task_id, attempt, key, shard, group_key, fence, holder, parked, cost, extra_keys, extra_shards
    """
)
# claims_stale_promoted_candidates / claims_delete_stale_promoted_one: promotions nobody bound before their dispatch
# deadline; the reaper voids the nonce (the DELETE) before the slot is reused (D5). No row = it was bound meanwhile.
CLAIMS_STALE_PROMOTED_CANDIDATES = sa.text(
    f"""
    SELECT task_id, attempt, fence FROM keyed_claims
     WHERE state = 'promoted' AND dispatch_deadline < {NOW} ORDER BY dispatch_deadline LIMIT :batch
    """
)
CLAIMS_DELETE_STALE_PROMOTED_ONE = sa.text(
    f"""
    DELETE FROM keyed_claims
     WHERE task_id = :task_id AND attempt = :attempt AND fence = :fence
       AND state = 'promoted' AND dispatch_deadline < {NOW}
    RETURNING task_id, attempt, key, shard, group_key, fence, parked, cost, extra_keys, extra_shards
    """
)


@dataclass(frozen=True)
class HeldClaim:
    """A claim the caller tracks: enough to renew and release it."""

    task_id: str
    attempt: int
    fence: int

    @property
    def token(self) -> Token:
        return Token(self.task_id, self.attempt)


@dataclass(frozen=True)
class Holding:
    """The slots a claim holds: ``cost`` of its first key on ``shard``, and of each extra key on its shard."""

    key: str | None
    shard: int | None
    extra_keys: tuple[str, ...] = ()
    extra_shards: tuple[int, ...] = ()
    cost: int = 1
    fair_key: str | None = None

    @classmethod
    def of(cls, row: Any) -> Holding:
        """The holding of a claim row (any row with key, shard and, optionally, the extra columns)."""
        return cls(
            key=row.key,
            shard=row.shard,
            extra_keys=tuple(getattr(row, "extra_keys", None) or ()),
            extra_shards=tuple(getattr(row, "extra_shards", None) or ()),
            cost=int(getattr(row, "cost", None) or 1),
            fair_key=getattr(row, "fair_key", None),
        )

    def slots(self) -> list[tuple[str, int]]:
        """Every (key, shard) held, in lock order."""
        if self.key is None or self.shard is None:
            return []
        return sorted([(self.key, self.shard), *zip(self.extra_keys, self.extra_shards, strict=True)])

    def params(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "shard": self.shard,
            "cost": self.cost,
            "extra_keys": list(self.extra_keys) or None,
            "extra_shards": list(self.extra_shards) or None,
            "fair_key": self.fair_key,
        }


def claims_insert_running(
    conn: sa.Connection,
    token: Token,
    *,
    key: str | None,
    shard: int | None,
    group_key: str | None,
    holder: str,
    lease: float,
    parked: str | None = None,
    holding: Holding | None = None,
    supersede_key: str | None = None,
    now: datetime | None = None,
) -> int:
    """Insert the running claim for a slot the caller has just taken; its fence. ``parked``: the waiting row
    it came from (a promotion run by its releaser), kept so that a lost run goes back in line. ``holding``:
    the slots taken when they are more than one slot of ``key`` (extra keys, a cost). ``supersede_key``: the
    attempt's, so that a newer arrival of its key can ask for its cancellation (newest wins)."""
    params = {
        "task_id": token.task_id,
        "attempt": token.attempt,
        **(holding or Holding(key, shard)).params(),
        "group_key": group_key,
        "holder": holder,
        "lease": lease,
        "parked": parked,
        "supersede_key": supersede_key,
        "now": now,
    }
    return int(conn.execute(CLAIMS_INSERT_RUNNING, params).scalar_one())


def claims_insert_promoted(
    conn: sa.Connection,
    token: Token,
    *,
    key: str | None,
    shard: int | None,
    group_key: str | None,
    nonce: uuid.UUID,
    dispatch: float,
    parked: str,
    holding: Holding | None = None,
    now: datetime | None = None,
) -> int:
    params = {
        "task_id": token.task_id,
        "attempt": token.attempt,
        **(holding or Holding(key, shard)).params(),
        "group_key": group_key,
        "nonce": nonce,
        "dispatch": dispatch,
        "parked": parked,
        "now": now,
    }
    return int(conn.execute(CLAIMS_INSERT_PROMOTED, params).scalar_one())


def claims_bind_promoted(
    conn: sa.Connection, token: Token, nonce: uuid.UUID, *, holder: str, lease: float, now: datetime | None = None
) -> int | None:
    """Bind a promotion to its receiver: the fence, or None when the token/nonce is not a live promotion."""
    params = {
        "task_id": token.task_id,
        "attempt": token.attempt,
        "nonce": nonce,
        "holder": holder,
        "lease": lease,
        "now": now,
    }
    return conn.execute(CLAIMS_BIND_PROMOTED, params).scalar_one_or_none()


def claims_delete_fenced(conn: sa.Connection, token: Token, fence: int) -> ClaimRow | None:
    """Delete the claim held with ``fence``; the row when this call released it, None when it did not."""
    params = {"task_id": token.task_id, "attempt": token.attempt, "fence": fence}
    return conn.execute(CLAIMS_DELETE_FENCED, params).first()


def claims_hold_uncertain(
    conn: sa.Connection, token: Token, fence: int, outcome: str, *, hold: float | None, now: datetime | None = None
) -> bool:
    """Keep the claim's slots for the uncertain hold instead of releasing them; False when no hold applies."""
    params = {
        "task_id": token.task_id,
        "attempt": token.attempt,
        "fence": fence,
        "outcome": outcome,
        "hold": hold,
        "now": now,
    }
    return conn.execute(CLAIMS_HOLD_UNCERTAIN, params).first() is not None


# claims_unkey: an attempt gives its concurrency slots back early and runs on unkeyed (release_concurrency);
# same guard as a release. Returns what it held, for the caller to give back.
CLAIMS_UNKEY = sa.text(
    """
    UPDATE keyed_claims c SET key = NULL, shard = NULL, extra_keys = NULL, extra_shards = NULL, cost = 1
      FROM (SELECT task_id, attempt, key, shard, extra_keys, extra_shards, cost FROM keyed_claims
             WHERE task_id = :task_id AND attempt = :attempt FOR UPDATE) old
     WHERE c.task_id = old.task_id AND c.attempt = old.attempt AND c.fence = :fence AND c.state = 'running'
       AND c.key IS NOT NULL
    RETURNING old.key, old.shard, old.extra_keys, old.extra_shards, old.cost
    """
)


def claims_renew(
    conn: sa.Connection, holder: str, held: Iterable[HeldClaim], *, lease: float, now: datetime | None = None
) -> set[HeldClaim]:
    """Renew the leases of ``held`` (attempts this process tracks); the subset still held."""
    held = list(held)
    if not held:
        return set()
    params = {
        "task_ids": [h.task_id for h in held],
        "attempts": [h.attempt for h in held],
        "fences": [h.fence for h in held],
        "holder": holder,
        "lease": lease,
        "now": now,
    }
    return {HeldClaim(r.task_id, r.attempt, r.fence) for r in conn.execute(CLAIMS_RENEW, params)}


def claims_request_cancel(
    conn: sa.Connection, *, key: str, supersede_key: str, task_id: str, detail: str, now: datetime | None = None
) -> list[tuple[str, int, str | None]]:
    """Ask for the cancellation of the attempts of ``key`` and ``supersede_key`` that hold a slot, of tasks that arrived
    no later than ``task_id`` (newest wins); (task id, attempt, holder) of each."""
    params = {"key": key, "supersede_key": supersede_key, "task_id": task_id, "detail": detail, "now": now}
    return [(r.task_id, int(r.attempt), r.holder) for r in conn.execute(CLAIMS_REQUEST_CANCEL, params)]


def claims_cancel_requested(conn: sa.Connection, holder: str, held: Iterable[HeldClaim]) -> dict[HeldClaim, str]:
    """Of ``held`` (claims this holder renews), those whose cancellation a newer arrival asked for, with its detail."""
    held = list(held)
    if not held:
        return {}
    params = {
        "task_ids": [h.task_id for h in held],
        "attempts": [h.attempt for h in held],
        "fences": [h.fence for h in held],
        "holder": holder,
    }
    return {
        HeldClaim(r.task_id, r.attempt, r.fence): r.cancel_detail for r in conn.execute(CLAIMS_CANCEL_REQUESTED, params)
    }
