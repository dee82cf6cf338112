"""The slot ledger: pure Postgres (SQLAlchemy Core + psycopg 3). It imports neither Celery nor Django.

Each table module (names, overrides, slots, keys, claims, waiting, groups, books, holders, events) owns one table
and its guarded statements; ``fast_paths`` holds the one-statement claims and releases that span tables. The
transactions compose them, each layer importing only those below it (no cycle):

    tables, fast_paths < promote < outcomes < admit, release < revoke < reconcile < Ledger (this module)

``promote`` gives free slots to waiters; ``outcomes`` records a task's final outcome and moves its group on;
``admit`` is admit-or-park and bind; ``release`` the release-and-promote; ``revoke`` the stored revoke;
``reconcile`` the background repairs.
``Ledger`` wraps an engine and runs each operation in its own transaction, retrying on a detected deadlock
or serialization failure (both are safe to retry: nothing was committed).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError, IntegrityError

from celery_keyed.ledger import admit, outcomes, overrides, promote, reconcile, release, revoke
from celery_keyed.ledger.attempts import (
    Admission,
    Arrival,
    Outcome,
    Promotion,
    ReleaseReport,
    TaskOutcome,
    Token,
    Verdict,
)
from celery_keyed.ledger.books import (
    books_balance,
    books_mark_notified,
    books_open_idle,
    books_reject_unkeyable,
    books_unnotified,
)
from celery_keyed.ledger.bounds import (
    INT_MAX,
    SECONDS_MAX,
    SLOT_LIMIT_MAX,
    STATEMENT_TIMEOUT_MAX,
    check_int,
    check_seconds,
)
from celery_keyed.ledger.claims import HeldClaim, claims_renew
from celery_keyed.ledger.errors import InvalidConfig, InvalidKey, LedgerError, SchemaMissing, WrongState, translate
from celery_keyed.ledger.explain import Explanation, explain
from celery_keyed.ledger.groups import groups_register
from celery_keyed.ledger.holders import (
    holders_gone,
    holders_register,
    holders_set_pids,
    machine_identity,
    new_holder,
)
from celery_keyed.ledger.keys import keys_captured_by
from celery_keyed.ledger.keyspec import key_name, normalize_key, validate_name
from celery_keyed.ledger.migrations import applied_versions, migrate, schema_missing, schema_required
from celery_keyed.ledger.names import NameConfig, configure_names, parse_limits
from celery_keyed.ledger.overrides import clear_override, override_get, set_override
from celery_keyed.ledger.promote import DEFAULT_DISPATCH_TIMEOUT, LocalHandoff
from celery_keyed.ledger.reconcile import (
    DEFAULT_RESERVE_TIMEOUT,
    Report,
    check_counters_once,
    drop_idle_keys_once,
    prune_books_once,
    reclaim_once,
    reconcile_once,
    sweep_once,
)
from celery_keyed.ledger.status import (
    KeyStatus,
    NameStatus,
    status_key_count,
    status_keys,
    status_names,
    status_now,
    status_prepare,
)

__all__ = [
    "DEFAULT_DISPATCH_TIMEOUT",
    "DEFAULT_RESERVE_TIMEOUT",
    "INT_MAX",
    "SECONDS_MAX",
    "SLOT_LIMIT_MAX",
    "STATEMENT_TIMEOUT_MAX",
    "Admission",
    "Arrival",
    "Explanation",
    "HeldClaim",
    "InvalidConfig",
    "InvalidKey",
    "KeyStatus",
    "Ledger",
    "LedgerError",
    "LocalHandoff",
    "NameConfig",
    "NameStatus",
    "Outcome",
    "Promotion",
    "ReleaseReport",
    "Report",
    "SchemaMissing",
    "TaskOutcome",
    "Token",
    "Verdict",
    "WrongState",
    "applied_versions",
    "books_balance",
    "books_mark_notified",
    "books_reject_unkeyable",
    "books_unnotified",
    "check_counters_once",
    "check_int",
    "check_seconds",
    "claims_renew",
    "clear_override",
    "configure_names",
    "drop_idle_keys_once",
    "explain",
    "groups_register",
    "key_name",
    "keys_captured_by",
    "migrate",
    "new_holder",
    "normalize_key",
    "override_get",
    "parse_limits",
    "prune_books_once",
    "reclaim_once",
    "reconcile_once",
    "schema_missing",
    "set_override",
    "status_key_count",
    "status_keys",
    "status_names",
    "status_now",
    "status_prepare",
    "sweep_once",
    "validate_name",
]

T = TypeVar("T")

#: ping: the cheapest round trip, the breaker's probe that the ledger's database answers (D9).
PING = sa.text("SELECT 1")

#: SQLSTATEs that mean "nothing happened, run the transaction again".
_RETRYABLE = {"40P01", "40001"}  # deadlock_detected, serialization_failure


class Ledger:
    """The ledger bound to an engine and to one holder (a worker process start, D6).

    Every method runs one transaction. ``lease`` is how long a claim lives without renewal; ``dispatch`` how
    long a promoted attempt may wait to be bound.
    """

    def __init__(
        self,
        engine: sa.Engine,
        *,
        holder: str | None = None,
        lease: float = 60.0,
        dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    ) -> None:
        self.engine = engine
        #: The same pool in autocommit: the single-statement fast paths need no BEGIN / COMMIT round trips.
        self.autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self.holder = holder or new_holder()
        self.lease = lease
        self.dispatch = dispatch

    def transaction(self, work: Callable[[sa.Connection], T], *, attempts: int = 5) -> T:
        """Run ``work(conn)`` in a transaction; retry it on deadlock or serialization failure. A violated named
        constraint raises its domain error (``errors.translate``: :class:`InvalidConfig` or :class:`WrongState`)."""
        for attempt in range(attempts):
            try:
                with self.engine.begin() as conn:
                    return work(conn)
            except IntegrityError as exc:  # a named constraint (CHECK, UNIQUE) becomes its domain error
                domain = translate(exc)
                if domain is exc:
                    raise
                raise domain from exc
            except DBAPIError as exc:
                code = getattr(getattr(exc.orig, "diag", None), "sqlstate", None) or getattr(exc.orig, "sqlstate", None)
                if code not in _RETRYABLE or attempt == attempts - 1:
                    raise
                time.sleep(0.001 * (2**attempt))
        raise AssertionError("unreachable")

    def register_holder(self, *, pids: list[int] | None = None, now: datetime | None = None) -> None:
        """Record this process as a holder (the worker's first ledger call at start); ``pids``: the processes
        that may run its bodies (main and pool). A database without the ledger's tables raises
        :class:`SchemaMissing`, which says to run ``celery keyed migrate``."""
        machine = machine_identity()
        with schema_required(self.engine):
            self.transaction(lambda conn: holders_register(conn, self.holder, machine=machine, pids=pids, now=now))

    def record_pids(self, pids: list[int], *, now: datetime | None = None) -> None:
        self.transaction(lambda conn: holders_set_pids(conn, self.holder, pids, now=now))

    def reclaim_gone_predecessors(self, *, now: datetime | None = None) -> Report:
        """Give back at once the running claims of earlier worker starts on this machine whose processes are
        all gone (a worker SIGKILLed and restarted), instead of after their leases. Holders elsewhere, or whose
        processes cannot be checked, are left to the reaper."""
        machine = machine_identity()
        if machine is None:
            return Report()
        with self.engine.connect() as conn:
            gone = holders_gone(conn, self.holder, machine)
        return reconcile.reclaim_gone_holders_once(self.engine, gone, now=now, dispatch=self.dispatch)

    def configure(self, limits: Mapping[str, NameConfig], *, now: datetime | None = None) -> list[Promotion]:
        with schema_required(self.engine):
            return self.transaction(lambda conn: configure_names(conn, limits, dispatch=self.dispatch, now=now))

    def admit(self, arrival: Arrival, *, now: datetime | None = None) -> Admission:
        with self.autocommit.connect() as conn:
            fast, fresh = admit.admit_autocommit(conn, arrival, holder=self.holder, lease=self.lease, now=now)
        if fast is not None:
            return fast
        return self.transaction(
            lambda conn: admit.admit(
                conn, arrival, holder=self.holder, lease=self.lease, fresh=fresh, dispatch=self.dispatch, now=now
            )
        )

    def bind(self, token: Token, nonce: uuid.UUID, *, now: datetime | None = None) -> int | None:
        return self.transaction(
            lambda conn: admit.bind(conn, token, nonce, holder=self.holder, lease=self.lease, now=now)
        )

    def release(
        self,
        token: Token,
        fence: int,
        outcome: Outcome,
        *,
        detail: str = "",
        contended: bool = False,
        local_queues: Iterable[str] | None = None,
        local_tasks: Iterable[str] | None = None,
        uncertain: bool = False,
        hold: float | None = None,
        now: datetime | None = None,
    ) -> ReleaseReport:
        """Release a claim. Uncontended, it is a self-committing statement and a read; for a ``contended`` key
        (the caller saw it park attempts recently) the release and the promotion it makes are one transaction,
        so the freed slot is never visible to anyone else (a sweeper would take it and republish).
        ``local_queues`` / ``local_tasks``: the caller runs promotions of these itself (D4); they come back
        already bound to this holder (``Promotion.nonce is None``). ``uncertain`` / ``hold``: the attempt ended by
        a hard time limit or a lost worker; an uncertain hold keeps its slots (see ``release.release``)."""
        local = None
        if local_queues is not None:
            local = LocalHandoff(
                holder=self.holder, lease=self.lease, queues=frozenset(local_queues), tasks=frozenset(local_tasks or ())
            )

        def in_transaction(conn: sa.Connection) -> ReleaseReport:
            return release.release(
                conn,
                token,
                fence,
                outcome,
                detail=detail,
                dispatch=self.dispatch,
                local=local,
                uncertain=uncertain,
                hold=hold,
                now=now,
            )

        if contended or uncertain:
            return self.transaction(in_transaction)
        with self.autocommit.connect() as conn:
            fast = release.release_autocommit(conn, token, fence, outcome, detail=detail, now=now)
        if fast is None:
            return self.transaction(in_transaction)
        report, rest = fast
        if rest is not None:
            waited, key, has_shadow = rest
            report.promotions += self.transaction(
                lambda conn: release.after_release_autocommit(
                    conn, token, waited, key, has_shadow, outcome, dispatch=self.dispatch, local=local, now=now
                )
            )
        return report

    def release_early(
        self, token: Token, fence: int, *, now: datetime | None = None
    ) -> tuple[bool, list[Promotion]]:
        """Give back a running attempt's concurrency slots before its outcome (``release_concurrency``)."""
        return self.transaction(
            lambda conn: release.release_early(conn, token, fence, dispatch=self.dispatch, now=now)
        )

    def renew(self, held: Iterable[HeldClaim], *, now: datetime | None = None) -> set[HeldClaim]:
        held = list(held)
        return self.transaction(lambda conn: claims_renew(conn, self.holder, held, lease=self.lease, now=now))

    def confirm(self, token: Token, fence: int, *, now: datetime | None = None) -> bool:
        """Bind a start to a claim taken earlier (D14): True when the claim of ``token`` is still this holder's,
        running, with ``fence`` (its lease renewed); False when it lapsed or was taken back. One
        self-committing statement."""
        with self.autocommit.connect() as conn:
            held = HeldClaim(token.task_id, token.attempt, fence)
            return bool(claims_renew(conn, self.holder, [held], lease=self.lease, now=now))

    def open_idle(self, *, age: float, limit: int = 100, now: datetime | None = None) -> list[str]:
        """Open tasks with no claim and no waiting row that arrived over ``age`` seconds ago (D15)."""
        with self.engine.connect() as conn:
            return books_open_idle(conn, age=age, limit=limit, now=now)

    def settle(
        self, task_id: str, outcome: str, *, detail: str, now: datetime | None = None
    ) -> tuple[bool, list[Promotion]]:
        """Record the final outcome of an open task with no attempt left in the ledger, from its stored result
        (its body ended but its release never committed, D15): ``completed`` or ``failed``."""
        if outcome not in (TaskOutcome.COMPLETED, TaskOutcome.FAILED):
            raise ValueError(f"a task is settled as completed or failed, not {outcome!r}")
        final = TaskOutcome(outcome)
        return self.transaction(
            lambda conn: outcomes.settle(conn, task_id, final, detail=detail, dispatch=self.dispatch, now=now)
        )

    def revoke(self, task_id: str, *, now: datetime | None = None) -> list[Promotion]:
        return self.transaction(lambda conn: revoke.revoke(conn, task_id, dispatch=self.dispatch, now=now))

    def set_override(
        self,
        name: str,
        limit: int,
        *,
        reason: str,
        author: str = "",
        expires_at: datetime | None = None,
        now: datetime | None = None,
    ) -> list[Promotion]:
        with schema_required(self.engine):
            return self.transaction(
                lambda conn: set_override(
                    conn, name, limit, reason=reason, author=author, expires_at=expires_at, dispatch=self.dispatch,
                    now=now,
                )
            )

    def clear_override(
        self, name: str, *, reason: str = "", author: str = "", now: datetime | None = None
    ) -> list[Promotion]:
        with schema_required(self.engine):
            return self.transaction(
                lambda conn: clear_override(conn, name, reason=reason, author=author, dispatch=self.dispatch, now=now)
            )

    def promote_key(self, key: str, *, now: datetime | None = None) -> list[Promotion]:
        return self.transaction(lambda conn: promote.promote_key(conn, key, dispatch=self.dispatch, now=now))

    def sweep(
        self,
        *,
        now: datetime | None = None,
        group_arrival_timeout: float = 300.0,
        reserve_timeout: float = DEFAULT_RESERVE_TIMEOUT,
    ) -> Report:
        with schema_required(self.engine):
            return sweep_once(
                self.engine,
                now=now,
                group_arrival_timeout=group_arrival_timeout,
                dispatch=self.dispatch,
                reserve_timeout=reserve_timeout,
            )

    def reconcile(
        self,
        *,
        now: datetime | None = None,
        idle: float = 3600.0,
        group_arrival_timeout: float = 300.0,
        reserve_timeout: float = DEFAULT_RESERVE_TIMEOUT,
        books_retention: float | None = None,
    ) -> Report:
        """One reconcile run (the beat task's); ``books_retention``: prune finished task ids older than this many
        seconds (None keeps them; the setting ``keyed_books_retention`` defaults to 7 days)."""
        with schema_required(self.engine):
            return reconcile_once(
                self.engine,
                lease=self.lease,
                now=now,
                idle=idle,
                group_arrival_timeout=group_arrival_timeout,
                dispatch=self.dispatch,
                reserve_timeout=reserve_timeout,
                books_retention=books_retention,
            )

    def prune_books(self, retention: float, *, now: datetime | None = None) -> int:
        """Forget finished task ids older than ``retention`` seconds, in bounded batches (part of ``reconcile``)."""
        with schema_required(self.engine):
            return prune_books_once(self.engine, retention=retention, now=now)

    def explain(self, task_id: str, *, now: datetime | None = None) -> Explanation:
        with schema_required(self.engine), self.engine.connect() as conn:
            return explain(conn, task_id, now=now)

    def books(self) -> dict[str, int]:
        with schema_required(self.engine), self.engine.connect() as conn:
            return books_balance(conn)

    # -- for the worker's gate: each one call, so the gate needs no ledger module and no engine of its own --------

    def reclaim(self, *, now: datetime | None = None) -> Report:
        """Reclaim expired leases and void unbound promotions (``reclaim_once``; the caller has reached the ledger
        for a full lease first, D7)."""
        return reclaim_once(self.engine, lease=self.lease, now=now, dispatch=self.dispatch)

    def reject_unkeyable(self, task_id: str, *, task_name: str, detail: str, now: datetime | None = None) -> None:
        """Book an arrival whose keys cannot be read as rejected, its failure result stored by the caller (D16)."""
        self.transaction(
            lambda conn: books_reject_unkeyable(conn, task_id, task_name=task_name, detail=detail, now=now)
        )

    def unnotified(self, *, limit: int = 500) -> list[sa.Row[Any]]:
        """Tasks that never ran whose failure result is not stored yet (D11)."""
        with self.engine.connect() as conn:
            return books_unnotified(conn, limit)

    def mark_notified(self, task_ids: list[str]) -> None:
        """Their failure results are stored."""
        self.transaction(lambda conn: books_mark_notified(conn, task_ids))

    def captured_keys(self, names: list[str]) -> list[sa.Row[Any]]:
        """Per name, the keys seen while it was a K = 1 identity (prefix capture, DESIGN §3.11)."""
        with self.engine.connect() as conn:
            return keys_captured_by(conn, names)

    def ping(self) -> None:
        """One round trip: raises the driver's error when the ledger's database cannot be reached (the breaker's
        probe, D9)."""
        with self.engine.connect() as conn:
            conn.execute(PING)


_ = (overrides,)  # imported for its side of the layering; its functions are re-exported above
