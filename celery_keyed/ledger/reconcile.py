"""Background repair of the ledger: ``sweep_once`` (due times, every ``keyed_sweep_interval``) and
``reconcile_once`` (leases, counters, idle keys, the books' retention; the beat task). Both take an engine and run
one short transaction per item, so they never hold many locks and are safe to run in several processes at once
(every step is a guarded statement with SKIP LOCKED; the loser of a race does nothing).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import (
    books,
    call_limits,
    claims,
    fair_weights,
    groups,
    keys,
    overrides,
    slots,
    waiting,
    windows,
)
from celery_keyed.ledger.attempts import Outcome, Promotion, TaskOutcome, Token
from celery_keyed.ledger.claims import Holding
from celery_keyed.ledger.events import events_prune, events_record
from celery_keyed.ledger.key_overrides import lapse_one_key_override
from celery_keyed.ledger.keyspec import key_name
from celery_keyed.ledger.outbox import outbox_retries_missing, outbox_retries_over
from celery_keyed.ledger.outcomes import finish_never_ran
from celery_keyed.ledger.promote import (
    DEFAULT_DISPATCH_TIMEOUT,
    give_back_reserved,
    give_back_to_lines,
    promote_each_key,
    promote_freed,
    promote_group,
    promote_key,
    promote_multi,
)
from celery_keyed.ledger.release import after_claim_removed
from celery_keyed.ledger.sent import sent_drop_over

logger = logging.getLogger("celery_keyed.ledger")

_BATCH = 500

#: Seconds a multi-key waiter may hold reserved slots before they are given back (docs/ledger.md).
DEFAULT_RESERVE_TIMEOUT = 60.0

#: Finished task ids pruned per transaction, and at most this many transactions per reconcile run: the work of one
#: run stays bounded (a backlog, e.g. after enabling retention on old books, drains over several runs).
PRUNE_BATCH = 1000
PRUNE_BATCHES = 20

@dataclass
class Report:
    """What one sweep or reconcile run did. ``promotions`` must be dispatched by the caller; ``finished``
    lists tasks that got a final outcome without running (their failure results are due, D11)."""

    promotions: list[Promotion] = field(default_factory=list)
    finished: list[tuple[str, TaskOutcome]] = field(default_factory=list)
    reclaimed: list[Token] = field(default_factory=list)
    voided: list[Token] = field(default_factory=list)
    drift: list[str] = field(default_factory=list)
    expired: int = 0
    lost: int = 0
    dropped_keys: int = 0
    due: int = 0
    pruned: int = 0  # finished task ids forgotten after the books' retention
    sends_dropped: int = 0  # reservations of sends (keyed_sent) whose task finished or never arrived
    retries_missing: int = 0  # tasks between attempts whose retry is overdue (registered at its publish, not arrived)
    windows_pruned: int = 0  # keys whose rate windows hold no start any window can count

    def merge(self, other: Report) -> Report:
        for name in ("promotions", "finished", "reclaimed", "voided", "drift"):
            getattr(self, name).extend(getattr(other, name))
        for name in ("expired", "lost", "dropped_keys", "due", "pruned", "sends_dropped"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self


def sweep_once(
    engine: sa.Engine,
    *,
    now: datetime | None = None,
    group_arrival_timeout: float = 300.0,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    reserve_timeout: float = DEFAULT_RESERVE_TIMEOUT,
) -> Report:
    """Everything time makes happen (D2): not-before times that passed, waiters past their latest start,
    reservations held longer than ``reserve_timeout``, uncertain holds that are over, overrides that lapse,
    registered group numbers never received, and — as the backstop for any wakeup a lock-order skip left
    behind — promotion of every key and group that has promotable waiters. Each step is its own function, in
    this order; each row is handled in a transaction of its own."""
    report = Report()
    with engine.begin() as conn:
        due = conn.execute(waiting.WAITING_CLEAR_DUE, {"batch": _BATCH, "now": now}).all()
    report.due = len(due)
    _expire_waiters(engine, report, dispatch=dispatch, now=now)
    _lapse_reservations(engine, report, reserve_timeout=reserve_timeout, dispatch=dispatch, now=now)
    with engine.begin() as conn:
        report.promotions += overrides.expire_overrides(conn, dispatch=dispatch, now=now)
        fair_weights.expire_fair_weights(conn, now=now)  # read as lapsed already; this writes the audit row
    _settle_orphan_shadows(engine, now=now)
    while True:  # key overrides (0014): a key pause that ended, a key limit that lapsed: the key's waiters start (D2)
        with engine.begin() as conn:
            found, promoted = lapse_one_key_override(conn, dispatch=dispatch, now=now)
            report.promotions += promoted
        if not found:
            break
    _record_lost_members(engine, report, group_arrival_timeout=group_arrival_timeout, dispatch=dispatch, now=now)
    _end_uncertain_holds(engine, report, dispatch=dispatch, now=now)
    report.merge(reshard_once(engine, dispatch=dispatch, now=now))
    report.merge(promote_all(engine, now=now, dispatch=dispatch))
    return report


def _expire_waiters(engine: sa.Engine, report: Report, *, dispatch: float, now: datetime | None) -> None:
    """Waiters past their latest start: recorded expired (a shadow is only removed), their reservations given
    back and promoted."""
    while True:
        with engine.begin() as conn:
            rows = conn.execute(waiting.WAITING_DELETE_EXPIRED, {"batch": 1, "now": now}).all()
            freed = [fr for r in rows for fr in give_back_reserved(conn, r, now=now)]
            for r in rows:
                if r.key is not None:
                    keys.keys_remove_waiting(conn, r.key, now=now)
                if not r.shadow:
                    report.promotions += finish_never_ran(
                        conn,
                        Token(r.task_id, r.attempt),
                        TaskOutcome.EXPIRED,
                        detail="not started before its deadline",
                        dispatch=dispatch,
                        message=r.message,
                        now=now,
                    )
                    report.finished.append((r.task_id, TaskOutcome.EXPIRED))
                    report.expired += 1
            report.promotions += promote_freed(conn, freed, dispatch=dispatch, now=now)
        if not rows:
            break


def _lapse_reservations(
    engine: sa.Engine, report: Report, *, reserve_timeout: float, dispatch: float, now: datetime | None
) -> None:
    """Reservations held longer than ``reserve_timeout``: given back, and what they held promoted."""
    while True:
        with engine.begin() as conn:
            lapsed = conn.execute(
                waiting.WAITING_RESERVATIONS_LAPSED, {"timeout": reserve_timeout, "batch": 1, "now": now}
            ).all()
            freed = [fr for r in lapsed for fr in give_back_reserved(conn, r, now=now)]
            report.promotions += promote_freed(conn, freed, dispatch=dispatch, now=now)
        if not lapsed:
            break


def _settle_orphan_shadows(engine: sa.Engine, *, now: datetime | None) -> None:
    """Shadows (D8) whose claim is gone: dropped when their attempt is over, else made live."""
    with engine.connect() as conn:
        orphans = conn.execute(waiting.WAITING_ORPHAN_SHADOWS, {"batch": _BATCH}).all()
    for o in orphans:
        with engine.begin() as conn:
            conn.execute(books.BOOKS_LOCK_TASK, {"task_id": o.task_id})
            if o.key is not None:
                keys.keys_lock(conn, o.key, key_name(o.key), now=now)
            over = conn.execute(books.BOOKS_ATTEMPT_IS_OVER, {"task_id": o.task_id, "attempt": o.attempt}).scalar()
            still = conn.execute(claims.CLAIMS_TOKEN_STATE, {"task_id": o.task_id, "attempt": o.attempt}).all()
            if any(r.kind == "claim" for r in still):
                continue  # claimed again meanwhile: still a shadow of a live attempt
            params = {"task_id": o.task_id, "attempt": o.attempt}
            if over:
                dropped = len(conn.execute(waiting.WAITING_SHADOW_DROP, params).all())
                if dropped and o.key is not None:
                    keys.keys_remove_waiting(conn, o.key, dropped, now=now)
            else:
                conn.execute(waiting.WAITING_SHADOW_LIVE, params)


def _record_lost_members(
    engine: sa.Engine, report: Report, *, group_arrival_timeout: float, dispatch: float, now: datetime | None
) -> None:
    """Registered group numbers never received within ``group_arrival_timeout``: recorded lost (D10), and their
    group moves on."""
    while True:
        with engine.begin() as conn:
            lost = conn.execute(
                groups.MEMBERS_DELETE_LOST, {"timeout": group_arrival_timeout, "batch": 1, "now": now}
            ).all()
            for m in lost:
                conn.execute(
                    books.BOOKS_RECORD_LOST,
                    {
                        "task_id": m.task_id,
                        "group_key": m.group_key,
                        "registered_at": m.registered_at,
                        "now": now,
                    },
                )
                report.finished.append((m.task_id, TaskOutcome.LOST))
                report.lost += 1
                report.promotions += promote_group(conn, m.group_key, dispatch=dispatch, now=now)
        if not lost:
            break


def _end_uncertain_holds(engine: sa.Engine, report: Report, *, dispatch: float, now: datetime | None) -> None:
    """Uncertain holds that are over: their claims removed with the outcome they were held with."""
    while True:
        with engine.begin() as conn:
            over = conn.execute(claims.CLAIMS_DELETE_UNCERTAIN_DUE, {"batch": 1, "now": now}).all()
            for row in over:
                released = after_claim_removed(
                    conn, row, Outcome(row.held_outcome), detail="uncertain hold over", dispatch=dispatch, now=now
                )
                report.promotions += released.promotions
                report.finished += released.finished
        if not over:
            break


def promote_all(
    engine: sa.Engine, *, now: datetime | None = None, dispatch: float = DEFAULT_DISPATCH_TIMEOUT
) -> Report:
    """Promote waiters of every key and group that has promotable rows and room (one transaction each)."""
    report = Report()
    with engine.connect() as conn:
        key_list = conn.execute(waiting.WAITING_KEYS_PROMOTABLE, {"limit": 10_000, "now": now}).scalars().all()
        group_list = conn.execute(waiting.WAITING_GROUPS_PROMOTABLE, {"limit": 10_000, "now": now}).scalars().all()
    for key in sorted(key_list):
        with engine.begin() as conn:
            report.promotions += promote_key(conn, key, dispatch=dispatch, now=now)
    for group_key in sorted(group_list):
        with engine.begin() as conn:
            report.promotions += promote_group(conn, group_key, dispatch=dispatch, now=now)
    with engine.connect() as conn:
        multi = conn.execute(waiting.WAITING_MULTI_PROMOTABLE, {"limit": 1_000, "now": now}).all()
    for m in multi:
        with engine.begin() as conn:
            report.promotions += promote_multi(
                conn, Token(m.task_id, m.attempt), dispatch=dispatch, now=now
            )
    return report


def reclaim_once(
    engine: sa.Engine,
    *,
    lease: float,
    now: datetime | None = None,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
) -> Report:
    """Reclaim running claims whose lease expired (D7) and void promotions nobody bound in time (D5).

    ``lease`` is the lease length: claims are only reclaimed once the database server has been up for that
    long. The caller (the beat task) must also have reached the ledger for a full lease before calling: a
    reconciler that was cut off cannot tell a dead worker from a worker that was cut off too.
    """
    report = Report()
    with engine.connect() as conn:
        candidates = conn.execute(claims.CLAIMS_EXPIRED_CANDIDATES, {"lease": lease, "batch": _BATCH, "now": now}).all()
    _reclaim_each(
        engine, candidates, claims.CLAIMS_DELETE_EXPIRED_ONE, {"now": now}, "lease expired", "", report, dispatch, now
    )
    with engine.connect() as conn:
        stale = conn.execute(claims.CLAIMS_STALE_PROMOTED_CANDIDATES, {"batch": _BATCH, "now": now}).all()
    for c in stale:
        with engine.begin() as conn:
            row = conn.execute(
                claims.CLAIMS_DELETE_STALE_PROMOTED_ONE,
                {"task_id": c.task_id, "attempt": c.attempt, "fence": c.fence, "now": now},
            ).first()
            if row is None:
                continue
            report.voided.append(Token(row.task_id, row.attempt))
            line = waiting.parked_line(row.parked)  # the line it stood in (several keys: not always its first)
            # Back in line: every free slot of its line is promoted, not only the one given back (D2).
            freed = give_back_to_lines(conn, Holding.of(row), {line} if line is not None else set(), now=now)
            for key in sorted({k for k, _ in freed} | ({line} if line is not None else set())):
                keys.keys_lock(conn, key, key_name(key), now=now)
            if waiting.waiting_restore(conn, row.parked) and line is not None:
                keys.keys_add_waiting(conn, line, force=True)
            report.promotions += promote_each_key(conn, freed, dispatch=dispatch, now=now)
            if row.group_key is not None:
                report.promotions += promote_group(conn, row.group_key, dispatch=dispatch, now=now)
    return report


def reclaim_gone_holders_once(
    engine: sa.Engine,
    holders: list[str],
    *,
    now: datetime | None = None,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
) -> Report:
    """Give back the running claims of ``holders``, worker process starts known to be dead (the caller checked
    that none of their processes exists), as "worker lost": the same book-keeping as the reaper's, without
    waiting for their leases to expire."""
    report = Report()
    if not holders:
        return report
    with engine.connect() as conn:
        candidates = conn.execute(claims.CLAIMS_OF_GONE_HOLDERS, {"holders": holders, "batch": 10 * _BATCH}).all()
    _reclaim_each(
        engine,
        candidates,
        claims.CLAIMS_DELETE_OF_GONE_HOLDER,
        {"holders": holders},
        "its worker is gone",
        " (its processes are gone)",
        report,
        dispatch,
        now,
    )
    return report


def _reclaim_each(
    engine: sa.Engine,
    candidates: Sequence[Any],
    delete: sa.TextClause,
    params: dict[str, Any],
    detail: str,
    event_note: str,
    report: Report,
    dispatch: float,
    now: datetime | None,
) -> None:
    """The reaper's side of the race for each candidate claim (one transaction each): ``delete`` (guarded by
    fence and its own rule) returns the row only to the winner, which records the event and books the attempt
    as "worker lost" (it goes back in line or waits for its redelivery); no row = the worker won."""
    for c in candidates:
        with engine.begin() as conn:
            row = conn.execute(delete, {"task_id": c.task_id, "attempt": c.attempt, "fence": c.fence, **params}).first()
            if row is None:
                continue
            events_record(
                conn,
                "reclaimed",
                key=row.key or row.group_key,
                task_id=row.task_id,
                detail=f"attempt {row.attempt} fence {row.fence} holder {row.holder}{event_note}",
                now=now,
            )
            released = after_claim_removed(conn, row, Outcome.WORKER_LOST, detail=detail, dispatch=dispatch, now=now)
            report.promotions += released.promotions
            report.reclaimed.append(Token(row.task_id, row.attempt))


def check_counters_once(engine: sa.Engine, *, repair: bool = True) -> list[str]:
    """Check every key's counters against the rows that exist (D1): ``used`` per shard = claims of the shard,
    ``waiting`` = parked rows. Locks the key's rows first, then counts in a later statement (a single
    UPDATE ... = (SELECT count(*)) under READ COMMITTED would overwrite a concurrent claim). Any drift is a
    bug: it is logged as an error, recorded as an event, and repaired."""
    drift: list[str] = []
    after = ""
    while True:
        with engine.connect() as conn:
            batch = conn.execute(slots.SLOTS_KEYS_AFTER, {"after": after, "batch": _BATCH}).scalars().all()
        if not batch:
            break
        for key in batch:
            with engine.begin() as conn:
                locked = conn.execute(slots.SLOTS_LOCK_COUNTERS, {"key": key}).all()
                counted = {r.shard: int(r.n) for r in conn.execute(slots.SLOTS_COUNT_CLAIMS, {"key": key})}
                for r in locked:
                    truth = counted.get(r.shard, 0)
                    if r.used != truth:
                        msg = f"{key} shard {r.shard}: used {r.used} but {truth} claims exist"
                        drift.append(msg)
                        logger.error("celery-keyed ledger drift (bug): %s; repaired", msg)
                        events_record(conn, "drift", key=key, detail=msg)
                        if repair:
                            conn.execute(slots.SLOTS_SET_USED, {"key": key, "shard": r.shard, "used": truth})
                head = conn.execute(keys.KEYS_LOCK_EXISTING, {"key": key}).first()
                if head is not None:
                    parked = int(conn.execute(waiting.WAITING_COUNT, {"key": key}).scalar_one())
                    if head.waiting != parked:
                        msg = f"{key}: waiting {head.waiting} but {parked} parked rows exist"
                        drift.append(msg)
                        logger.error("celery-keyed ledger drift (bug): %s; repaired", msg)
                        events_record(conn, "drift", key=key, detail=msg)
                        if repair:
                            conn.execute(keys.KEYS_SET_WAITING, {"key": key, "waiting": parked})
        after = batch[-1]
    return drift


def reshard_once(
    engine: sa.Engine, *, dispatch: float = DEFAULT_DISPATCH_TIMEOUT, now: datetime | None = None
) -> Report:
    """Move the keys whose slot rows still follow an older shard count of their name to the current one where every
    holding fits it (slots.slots_lock_all, in promote_key), and give the room that makes to their waiters. A key also
    moves on its own slow path and when its line is promoted; the sweep catches the rest within its interval (a
    release only frees its own row: moving the key there would lock its other rows out of order)."""
    report = Report()
    with engine.connect() as conn:
        behind = conn.execute(slots.SLOTS_LAYOUTS_BEHIND, {"batch": _BATCH}).scalars().all()
    for key in behind:
        with engine.begin() as conn:
            report.promotions += promote_key(conn, key, dispatch=dispatch, now=now)
    return report


def drop_idle_keys_once(engine: sa.Engine, *, idle: float = 3600.0, now: datetime | None = None) -> int:
    """Delete the rows of keys with nothing held or parked and no activity for ``idle`` seconds."""
    dropped = 0
    with engine.connect() as conn:
        candidates = conn.execute(keys.KEYS_IDLE, {"idle": idle, "batch": _BATCH, "now": now}).scalars().all()
    for key in candidates:
        with engine.begin() as conn:
            locked = conn.execute(slots.SLOTS_LOCK_COUNTERS, {"key": key}).all()
            if any(r.used for r in locked):
                continue
            head = conn.execute(keys.KEYS_LOCK_IDLE, {"key": key, "idle": idle, "now": now}).first()
            if head is None:
                continue
            conn.execute(slots.SLOTS_DROP_KEY, {"key": key})
            conn.execute(keys.KEYS_DROP_IDLE, {"key": key})
            dropped += 1
    return dropped


def prune_books_once(
    engine: sa.Engine,
    *,
    retention: float,
    now: datetime | None = None,
    batch: int = PRUNE_BATCH,
    batches: int = PRUNE_BATCHES,
) -> int:
    """Forget finished task ids whose outcome is older than ``retention`` seconds (``books_prune``: never an open
    task, never an outcome whose result is not stored yet), ``batch`` rows per transaction and at most ``batches``
    transactions; returns how many. The books still balance: each pruned id is counted by outcome. The ledger's
    events older than ``retention`` go the same way (``events_prune``; not counted: they are no books)."""
    pruned = 0
    for _ in range(batches):
        with engine.begin() as conn:
            n = books.books_prune(conn, retention=retention, batch=batch, now=now)
        pruned += n
        if n < batch:
            break
    for _ in range(batches):
        with engine.begin() as conn:
            if events_prune(conn, retention=retention, batch=batch, now=now) < batch:
                break
    return pruned


def reconcile_once(
    engine: sa.Engine,
    *,
    lease: float,
    now: datetime | None = None,
    idle: float = 3600.0,
    group_arrival_timeout: float = 300.0,
    dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    reserve_timeout: float = DEFAULT_RESERVE_TIMEOUT,
    books_retention: float | None = None,
) -> Report:
    """The periodic repair (beat task): reclaim dead leases and void unbound promotions, run the sweep,
    check counters against the claims that exist, drop idle keys (and their limits from the call, after a day), the
    rate windows of keys whose starts are all older than their longest window, and the reservations of sends that
    hold nothing any more (their task finished, or never arrived before its ``expires_at``), prune the books after
    ``books_retention`` seconds (None: keep every row). Returns a report."""
    report = reclaim_once(engine, lease=lease, now=now, dispatch=dispatch)
    report.merge(
        sweep_once(
            engine,
            now=now,
            group_arrival_timeout=group_arrival_timeout,
            dispatch=dispatch,
            reserve_timeout=reserve_timeout,
        )
    )
    report.drift += check_counters_once(engine)
    report.dropped_keys = drop_idle_keys_once(engine, idle=idle, now=now)
    with engine.begin() as conn:
        call_limits.prune(conn, idle=idle, now=now)
    report.windows_pruned = windows.prune(engine, now=now)
    report.sends_dropped = drop_sent_once(engine, now=now)
    report.retries_missing = report_missing_retries_once(engine, now=now)
    if books_retention is not None:
        report.pruned = prune_books_once(engine, retention=books_retention, now=now)
    return report


def drop_sent_once(engine: sa.Engine, *, now: datetime | None = None) -> int:
    """Drop reservations of sends accepted at send (``keyed_sent``) whose task has a final outcome or that never
    arrived before their ``expires_at``, in bounded batches; returns how many."""
    dropped = 0
    while True:
        with engine.begin() as conn:
            n = sent_drop_over(conn, now=now)
        dropped += n
        if n < 1000:
            return dropped


def report_missing_retries_once(engine: sa.Engine, *, now: datetime | None = None) -> int:
    """Tasks between attempts whose retry never arrived: drop the retry registrations that are over
    (``outbox.OUTBOX_RETRIES_OVER``), then count those overdue — a warning and a ``retry_missing`` event the first
    time each is seen. One with a copy in the outbox is the relay's to publish again; one without (the outbox is off
    for its task) is only reported: nothing can deliver it. Returns how many are overdue (at most 500 counted)."""
    while True:
        with engine.begin() as conn:
            if outbox_retries_over(conn) < 500:
                break
    with engine.begin() as conn:
        missing = outbox_retries_missing(conn, now=now)
        for retry in missing:
            if not retry.first:
                continue
            what = (
                f"the outbox relay publishes it again (published again {retry.republished} times so far)"
                if retry.has_copy
                else "no copy to publish again (the outbox is off for this task)"
            )
            detail = f"attempt {retry.attempt} of {retry.task_name or 'the task'} not received in time: {what}"
            events_record(conn, "retry_missing", key=retry.key or retry.group_key, task_id=retry.task_id,
                          detail=detail, now=now)
            logger.warning("celery-keyed reconcile: %s is between attempts and its retry never arrived: %s",
                           retry.task_id, detail)
    return len(missing)
