"""Release: the end of an attempt's claim, exactly once (DESIGN §3.4), and the promotions the freed room makes.

Only the actor whose DELETE returns the claim row gives its slots back: the worker's release (fenced by token and
fence) and the reaper's reclaim race for that row, and the loser does nothing. ``after_claim_removed`` is the
book-keeping every remover shares (worker, reaper, revoke, the end of an uncertain hold): the books, the slots, the
shadows (D8), the group's head, the promotions. Runs inside the caller's transaction (lock order as in ``admit``),
except ``release_autocommit``, the one-statement fast path, and ``release_and_promote``, the one-call release and
promotion of a batch (``Ledger.release`` / ``Ledger.release_many``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import books, claims, driver, fast_paths, groups, keys, slots, waiting
from celery_keyed.ledger.attempts import Outcome, Promotion, ReleaseReport, ReleaseRequest, Token
from celery_keyed.ledger.keyspec import key_name
from celery_keyed.ledger.outcomes import final_outcome, head_failure_policy, hold_group, unblock_head
from celery_keyed.ledger.promote import (
    DEFAULT_DISPATCH_TIMEOUT,
    LocalHandoff,
    give_back,
    give_back_to_lines,
    promote_each_key,
    promote_freed,
    promote_group,
)


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
    now: datetime | None = None,
) -> ReleaseReport:
    """Release the claim of ``token`` held with ``fence`` after ``outcome``, and promote what that makes ready.

    Idempotent and fenced: only the call whose DELETE returns the claim row gives the slot back; a second call,
    a stale worker (old fence) or a lost race with the reaper returns ``released=False`` and changes nothing.

    ``uncertain``: the attempt ended by a hard time limit or a lost worker, so the remote call it made may still
    be running. When an uncertain hold applies (``hold`` seconds, else its names' ``uncertain_hold``) the slots
    stay held until it is over (the sweep then gives them back); the task's outcome is recorded now.
    """
    if uncertain and _hold_uncertain(conn, token, fence, outcome, hold=hold, now=now):
        final = final_outcome(outcome, grouped=False)
        report = ReleaseReport(released=True)
        if final is not None and books.books_finish(
            conn, token.task_id, final, attempt=token.attempt, detail=detail, now=now
        ):
            report.finished.append((token.task_id, final))
        return report
    final = final_outcome(outcome, grouped=False)
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
        return after_claim_removed(conn, removed, outcome, detail=detail, dispatch=dispatch, local=local, now=now)
    report = ReleaseReport(released=True, finished=[(token.task_id, final)] if row.recorded and final else [])
    if row.has_shadow:
        _shadows_follow(conn, token, row.key, outcome, now=now)
    waited = _rooms_with_waiters(conn, row)
    for key in sorted({k for k, _ in waited}):
        keys.keys_lock(conn, key, key_name(key), now=now)
    report.promotions += promote_each_key(conn, waited, dispatch=dispatch, local=local, now=now)
    return report


def _rooms_with_waiters(conn: sa.Connection, row: Any) -> list[tuple[str, int]]:
    """The (key, shard) rows a fast release gave room on whose key has parked attempts (read after the slot
    rows' locks were taken: a new snapshot, D2), in lock order, once per free slot."""
    return [
        (key, shard)
        for key, shard, free in zip(row.room_keys, row.room_shards, row.room_free, strict=True)
        if conn.execute(keys.KEYS_GET_WAITING, {"key": key}).scalar()
        for _ in range(int(free))
    ]


def _hold_uncertain(
    conn: sa.Connection, token: Token, fence: int, outcome: Outcome, *, hold: float | None, now: datetime | None
) -> bool:
    conn.execute(books.BOOKS_LOCK_TASK, {"task_id": token.task_id})  # lock order: the task's row first
    return claims.claims_hold_uncertain(conn, token, fence, outcome.value, hold=hold, now=now)


def _release_fast(
    conn: sa.Connection,
    token: Token,
    fence: int,
    outcome: Outcome,
    final: str | None,
    *,
    detail: str,
    now: datetime | None,
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
    return conn.execute(fast_paths.RELEASE_FAST, params).first()


def release_autocommit(
    conn: sa.Connection, token: Token, fence: int, outcome: Outcome, *, detail: str = "", now: datetime | None = None
) -> tuple[ReleaseReport, Any] | None:
    """The release of a claim without a group as one self-committing statement (``conn`` in autocommit).
    Returns None when it released nothing (a grouped claim, or nothing to release: run ``release`` in a
    transaction), else the report and what is left to do: ``(key, shard, has_shadow)`` when the key may have waiters
    (read after the slot was given back, D2) or shadows — run ``after_release_autocommit`` for it."""
    if outcome is Outcome.WORKER_LOST:
        return None  # the general path: a lost run may go back in line from its stored message
    final = final_outcome(outcome, grouped=False)
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
    now: datetime | None = None,
) -> list[Promotion]:
    """The rest of an autocommitted release, in a transaction: shadows follow their attempt (``key``: its first
    key), and each slot it gave back on a key with waiters (``waited``) goes to that key's next waiter (one
    release, one promotion per slot: a releaser that found several free slots would otherwise start several
    attempts at once). Locks the shard rows, then the key rows (lock order)."""
    shadows = [(token, key, outcome)] if has_shadow else []
    return after_release_many(conn, shadows, waited, dispatch=dispatch, local=local, now=now)


def _shadows_follow(
    conn: sa.Connection, token: Token, key: str | None, outcome: Outcome, *, now: datetime | None
) -> None:
    """Duplicates kept as shadows of an attempt follow its fate (D8): live again if its worker was lost (the
    copy will run), dropped otherwise."""
    params = {"task_id": token.task_id, "attempt": token.attempt}
    if outcome is Outcome.WORKER_LOST:
        conn.execute(waiting.WAITING_SHADOW_LIVE, params)
        return
    dropped = len(conn.execute(waiting.WAITING_SHADOW_DROP, params).all())
    if dropped and key is not None:
        keys.keys_remove_waiting(conn, key, dropped, now=now)


# Complexity D on purpose: the steps after a claim's delete follow the lock order, read best in one place in order.
def after_claim_removed(
    conn: sa.Connection,
    row: Any,
    outcome: Outcome,
    *,
    detail: str,
    dispatch: float,
    local: LocalHandoff | None = None,
    now: datetime | None = None,
) -> ReleaseReport:
    """Book-keeping after a claim row was deleted by its owner or the reaper: the task's books (its row is
    locked first, lock order), the slot, the shadows (D8), the group's head, and the promotions."""
    token = Token(row.task_id, row.attempt)
    report = ReleaseReport(released=True)
    policy = head_failure_policy(conn, row.group_key, outcome)  # a failing group head: its group's policy
    final = final_outcome(outcome, grouped=row.group_key is not None, policy=policy)
    # The task's row first (lock order): an arrival of the same task holds it while it looks for this claim and
    # parks a duplicate as its shadow; taking it here means we see that shadow (or it sees the claim gone).
    conn.execute(books.BOOKS_LOCK_TASK, {"task_id": token.task_id})
    skipped_retry: Sequence[Any] = ()
    if final is not None:
        if outcome is Outcome.RETRY:  # skip: the head asked for a retry and is dead-lettered instead
            detail = f"dead-lettered at its failure, its group's policy is skip ({detail or 'a retry was asked for'})"
            # its retry, if it arrived already, leaves the waiting room (it was blocked behind this very attempt)
            skipped_retry = conn.execute(waiting.WAITING_DELETE_TASK, {"task_id": token.task_id}).all()
        if books.books_finish(conn, token.task_id, final, attempt=token.attempt, detail=detail, now=now):
            report.finished.append((token.task_id, final))
    elif outcome is Outcome.RETRY:
        books.books_attempt_over(conn, token.task_id, token.attempt)

    # A promoted attempt whose run was lost: its broker message was acked when it was parked, so it goes back in
    # line, in its old place, from the stored message (a copy the broker still holds is a duplicate, D8).
    parked = getattr(row, "parked", None) if outcome is Outcome.WORKER_LOST else None
    line = None if parked is None else waiting.parked_line(parked)
    # A lost run puts attempts back in line (its stored row, its shadows made live): new eligibility, so every
    # free slot of those keys is promoted, not only the one given back (D2: a shard over its share after the
    # shards or the limit changed frees nothing, while another shard of the key has room).
    lines = set() if outcome is not Outcome.WORKER_LOST else {line} if line is not None else set()
    if outcome is Outcome.WORKER_LOST:
        params = {"task_id": token.task_id, "attempt": token.attempt}
        lines |= set(conn.execute(waiting.WAITING_SHADOW_KEYS, params).scalars())
    freed = give_back_to_lines(conn, claims.Holding.of(row), lines, now=now)
    _shadows_follow(conn, token, row.key, outcome, now=now)
    to_lock = {key for key, _ in freed} | ({line} if line is not None else set())
    to_lock |= {r.key for r in skipped_retry if r.key is not None}
    for key in sorted(to_lock):
        keys.keys_lock(conn, key, key_name(key), now=now)
    for r in skipped_retry:
        if r.key is not None:
            keys.keys_remove_waiting(conn, r.key, now=now)
    if parked is not None and waiting.waiting_restore(conn, parked) and line is not None:
        keys.keys_add_waiting(conn, line, force=True)
    if policy == "hold":  # its group waits for an operator (before the next number could become the head)
        hold_group(conn, row.group_key, token, outcome, detail=detail, now=now)
    if row.group_key is not None and final is not None:
        groups.groups_lock(conn, row.group_key)
        groups.members_finish(conn, token.task_id)
        unblock_head(conn, row.group_key)
    report.promotions += promote_each_key(conn, freed, dispatch=dispatch, local=local, now=now)
    if row.group_key is not None:
        report.promotions += promote_group(conn, row.group_key, dispatch=dispatch, local=local, now=now)
    return report


def release_early(
    conn: sa.Connection,
    token: Token,
    fence: int,
    *,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: datetime | None = None,
) -> tuple[bool, list[Promotion]]:
    """Give back the concurrency slots of a running attempt before its outcome (``release_concurrency``): the
    claim row stays (books, fence, group) and the final release records the outcome as usual. Fenced like a
    release; (False, []) when there was nothing to give back."""
    conn.execute(books.BOOKS_LOCK_TASK, {"task_id": token.task_id})
    row = conn.execute(
        claims.CLAIMS_UNKEY, {"task_id": token.task_id, "attempt": token.attempt, "fence": fence}
    ).first()
    if row is None:
        return False, []
    freed = give_back(conn, claims.Holding.of(row), now=now)
    return True, promote_freed(conn, freed, dispatch=dispatch, now=now)


def batchable(request: ReleaseRequest) -> bool:
    """Whether ``release_and_promote`` may release it: not an uncertain end (its hold may keep the slots) and not a
    lost run (it may go back in line from its stored message); both take ``release``."""
    return not request.uncertain and request.outcome is not Outcome.WORKER_LOST


@dataclass
class FastReleases:
    """What ``release_and_promote`` did: ``rows`` one per request in input order (``released``, ``recorded``,
    ``has_shadow``, ``key``, ``room_keys`` / ``room_shards``: the rooms it gave back on keys with waiters, at the
    first request that gave back a slot on that key); ``promotions`` made in the same call; ``general``: keys whose
    line stopped at a head that is not plain (``after_release_many`` continues them)."""

    rows: list[Any]
    promotions: list[Promotion] = field(default_factory=list)
    general: list[str] = field(default_factory=list)


def _local_sets(requests: Sequence[ReleaseRequest]) -> tuple[list[dict[str, list[str]]], list[int | None]]:
    """The distinct local handoff sets the requests name (D4), and each request's index into them (None: none)."""
    sets: list[tuple[frozenset[str], frozenset[str]]] = []
    index: list[int | None] = []
    for r in requests:
        if r.local_queues is None:
            index.append(None)
            continue
        named = (r.local_queues, r.local_tasks or frozenset())
        if named not in sets:
            sets.append(named)
        index.append(sets.index(named))
    return [{"queues": sorted(q), "tasks": sorted(t)} for q, t in sets], index


def release_and_promote_params(
    requests: Sequence[ReleaseRequest],
    *,
    holder: str,
    lease: float,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: datetime | None = None,
) -> dict[str, Any]:
    """The values of ``fast_paths.RELEASE_AND_PROMOTE`` for ``requests`` (``release_and_promote``)."""
    sets, index = _local_sets(requests)
    return {
        "task_ids": [r.token.task_id for r in requests],
        "attempts": [r.token.attempt for r in requests],
        "fences": [r.fence for r in requests],
        "finals": [final_outcome(r.outcome, grouped=False) for r in requests],
        "details": [r.detail for r in requests],
        "now": now,
        "dispatch": dispatch,
        "local_holder": holder if sets else None,
        "local_lease": lease,
        "local_sets": json.dumps(sets),
        "local_set": index,
    }


def release_and_promote(
    conn: sa.Connection,
    requests: Sequence[ReleaseRequest],
    *,
    holder: str,
    lease: float,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    now: datetime | None = None,
) -> FastReleases:
    """Release a batch of ``batchable`` claims, check for waiters (D2) and promote the rooms freed, in one call
    (keyed_release_and_promote: one statement, one round trip; ``conn`` in autocommit makes it one transaction of
    its own, so the freed slot is never seen free by anyone else). A claim with a group, or nothing to release
    (stale fence, second call, reaped), comes back ``released=False``: ``release`` decides it. Promotions run by
    the releasers themselves (D4: every request with a room names the same ``local_queues`` / ``local_tasks``) are
    running claims of ``holder`` with ``lease`` (``Promotion.nonce`` None); the others carry a nonce (D5)."""
    params = release_and_promote_params(requests, holder=holder, lease=lease, dispatch=dispatch, now=now)
    done = FastReleases(rows=[])
    for row in driver.run(conn, fast_paths.RELEASE_AND_PROMOTE, params):
        if row.kind == "release":
            done.rows.append(row)
        elif row.kind == "promotion":
            done.promotions.append(
                Promotion(
                    task_id=row.task_id,
                    attempt=row.attempt,
                    nonce=row.nonce,
                    fence=row.fence,
                    key=row.key,
                    group_key=None,
                    queue=row.queue,
                    message=row.message,
                )
            )
        else:
            done.general.append(row.key)
    done.rows.sort(key=lambda row: row.ord)
    return done


def after_release_many(
    conn: sa.Connection,
    shadows: Sequence[tuple[Token, str | None, Outcome]],
    rooms: Sequence[tuple[str, int]],
    *,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    local: LocalHandoff | None = None,
    now: datetime | None = None,
) -> list[Promotion]:
    """The rest of released claims, in a transaction: shadows follow their attempts (``shadows``: token, first key,
    outcome; D8), and the free slots of ``rooms`` ((key, shard) rows) go to the next waiters of their keys
    (``promote_each_key``: any head, group, several keys, fair or rated names). Locks the shard rows in (key, shard)
    order, then the key rows in key order (lock order)."""
    uses = {
        (k, sh): conn.execute(slots.SLOTS_LOCK_ONE, {"key": k, "shard": sh, "name": key_name(k), "now": now}).first()
        for k, sh in sorted(set(rooms))
    }
    for k in sorted({k for k, _ in rooms} | {key for _, key, _ in shadows if key is not None}):
        keys.keys_lock(conn, k, key_name(k), now=now)
    for token, key, outcome in shadows:
        _shadows_follow(conn, token, key, outcome, now=now)
    free = [(k, sh) for (k, sh), use in uses.items() if use is not None for _ in range(max(0, use.share - use.used))]
    return promote_each_key(conn, free, dispatch=dispatch, local=local, now=now)
