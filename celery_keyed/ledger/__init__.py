"""The slot ledger: pure Postgres (SQLAlchemy Core + psycopg 3). It imports neither Celery nor Django.

Each table module (names, overrides, slots, keys, claims, waiting, groups, books, holders, events, sent, outbox)
owns one table and its guarded statements; ``fast_paths`` holds the one-statement claims and releases that span
tables. The transactions compose them, each layer importing only those below it (no cycle):

    tables, fast_paths < promote < outcomes, configure < parking < admit, release < revoke < reconcile
        < session < batches, controls, producers < Ledger (this module)

``promote`` gives free slots to waiters; ``outcomes`` records a task's final outcome and moves its group on;
``configure`` stores the names' configuration; ``admit`` is admit-or-park and bind (``parking``,
``redeliveries``, ``newest_wins``: its steps); ``release`` the release-and-promote; ``revoke`` the stored revoke;
``reconcile`` the background repairs; ``outcome_kinds`` the one table of final outcomes.

``Ledger`` (this module, the facade: one method per operation) is a ``session.LedgerSession`` — an engine, a
holder, connections and pins, each operation in its own transaction, retried on a detected deadlock or
serialization failure (both are safe to retry: nothing was committed) — whose admissions and releases follow the
batch policy of ``batches``, with the operator's controls (``controls``) and the producers' calls
(``producers``). docs/ledger.md draws the layout. Callers outside the ledger import from here only (``__all__``);
modules inside it import from each other.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import admit, outcomes, promote, reconcile, release, revoke
from celery_keyed.ledger.attempts import (
    Admission,
    Arrival,
    Outcome,
    Promotion,
    ReleaseReport,
    ReleaseRequest,
    TaskOutcome,
    Token,
    Verdict,
    check_debounce,
    check_on_newer,
)
from celery_keyed.ledger.batches import Batches
from celery_keyed.ledger.books import (
    books_balance,
    books_open_idle,
    books_reject_unkeyable,
)
from celery_keyed.ledger.bounds import (
    COST_MAX,
    EXCLUSIVE_COST,
    INT_MAX,
    SECONDS_MAX,
    SLOT_LIMIT_MAX,
    STATEMENT_TIMEOUT_MAX,
    check_int,
    check_seconds,
)
from celery_keyed.ledger.call_limits import check_call_limit
from celery_keyed.ledger.caps import Caps
from celery_keyed.ledger.claims import HeldClaim, claims_cancel_requested, claims_renew
from celery_keyed.ledger.configure import Configured, configure_names
from celery_keyed.ledger.controls import OperatorControls
from celery_keyed.ledger.errors import InvalidConfig, InvalidKey, LedgerError, SchemaMissing, WrongState
from celery_keyed.ledger.explain import Explanation, explain
from celery_keyed.ledger.fair_weights import (
    FAIR_WEIGHT_MAX,
    FAIR_WEIGHT_MIN,
    FairShare,
    check_prefix,
    check_weight,
    fair_shares,
    fair_weight_overrides,
)
from celery_keyed.ledger.group_policies import GroupHold, held_groups, held_groups_by_name
from celery_keyed.ledger.groups import groups_register
from celery_keyed.ledger.holders import (
    holders_gone,
    holders_latest,
    holders_register,
    holders_set_config_version,
    holders_set_pids,
    machine_identity,
    new_holder,
)
from celery_keyed.ledger.identity import ClaimHolding, FailoverLedger
from celery_keyed.ledger.key_overrides import KeyOverride, key_overrides_live
from celery_keyed.ledger.keys import keys_captured_by
from celery_keyed.ledger.keyspec import MAX_KEYS_PER_CALL, key_name, normalize_key, validate_name, validate_task_id
from celery_keyed.ledger.lost_books import LostArrival, LostBooks
from celery_keyed.ledger.migrations import (
    LedgerInUse,
    applied_versions,
    drop_ledger,
    ledger_objects,
    migrate,
    schema_missing,
    schema_required,
)
from celery_keyed.ledger.names import NameConfig, names_newest_version, parse_limits
from celery_keyed.ledger.never_ran import NeverRan, take_never_ran
from celery_keyed.ledger.outbox import outbox_by_name, outbox_register
from celery_keyed.ledger.outcome_kinds import NEVER_RAN_KINDS, OUTCOME_KINDS
from celery_keyed.ledger.overrides import clear_override, override_get, set_override
from celery_keyed.ledger.producers import ProducerCalls
from celery_keyed.ledger.promote import DEFAULT_DISPATCH_TIMEOUT
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
from celery_keyed.ledger.sent import SendVerdict, sent_admit, sent_by_name
from celery_keyed.ledger.session import per_transaction, server_unsafe_settings, settings_in_effect, startup_options
from celery_keyed.ledger.status import (
    KeyStatus,
    NameStatus,
    RecentStatus,
    limited_names_sql,
    name_limit_sql,
    status_key_count,
    status_keys,
    status_names,
    status_now,
    status_prepare,
    status_recent,
)
from celery_keyed.ledger.windows import rate_text, window_length_text, window_text

__all__ = [
    "COST_MAX",
    "DEFAULT_DISPATCH_TIMEOUT",
    "EXCLUSIVE_COST",
    "FAIR_WEIGHT_MAX",
    "FAIR_WEIGHT_MIN",
    "INT_MAX",
    "MAX_KEYS_PER_CALL",
    "NEVER_RAN_KINDS",
    "OUTCOME_KINDS",
    "SECONDS_MAX",
    "SLOT_LIMIT_MAX",
    "STATEMENT_TIMEOUT_MAX",
    "Admission",
    "Arrival",
    "ClaimHolding",
    "Explanation",
    "FailoverLedger",
    "FairShare",
    "GroupHold",
    "HeldClaim",
    "InvalidConfig",
    "InvalidKey",
    "KeyOverride",
    "KeyStatus",
    "Ledger",
    "LedgerError",
    "LedgerInUse",
    "LostArrival",
    "LostBooks",
    "NameConfig",
    "NameStatus",
    "Outcome",
    "Promotion",
    "RecentStatus",
    "ReleaseReport",
    "ReleaseRequest",
    "Report",
    "SchemaMissing",
    "SendVerdict",
    "TaskOutcome",
    "Token",
    "Verdict",
    "WrongState",
    "applied_versions",
    "check_call_limit",
    "check_counters_once",
    "check_debounce",
    "check_int",
    "check_on_newer",
    "check_prefix",
    "check_seconds",
    "check_weight",
    "clear_override",
    "drop_idle_keys_once",
    "drop_ledger",
    "fair_shares",
    "fair_weight_overrides",
    "groups_register",
    "held_groups",
    "held_groups_by_name",
    "holders_latest",
    "key_name",
    "key_overrides_live",
    "ledger_objects",
    "limited_names_sql",
    "migrate",
    "name_limit_sql",
    "names_newest_version",
    "new_holder",
    "normalize_key",
    "outbox_by_name",
    "outbox_register",
    "override_get",
    "parse_limits",
    "per_transaction",
    "rate_text",
    "schema_missing",
    "sent_admit",
    "sent_by_name",
    "set_override",
    "settings_in_effect",
    "startup_options",
    "status_key_count",
    "status_keys",
    "status_names",
    "status_now",
    "status_prepare",
    "status_recent",
    "validate_name",
    "validate_task_id",
    "window_length_text",
    "window_text",
]


logger = logging.getLogger("celery_keyed")

#: ping: the cheapest round trip, the breaker's probe that the ledger's database answers (D9).
PING = sa.text("SELECT 1")


class Ledger(OperatorControls, ProducerCalls):
    """The ledger bound to an engine and to one holder (a worker process start, D6).

    Every method runs one transaction (``session.LedgerSession``); admissions and releases follow the batch policy
    (``batches.Batches``); the operator's controls are ``controls.OperatorControls``'s, the producers' calls
    ``producers.ProducerCalls``'s. ``lease`` is how long a claim lives without renewal; ``dispatch`` how long a
    promoted attempt may wait to be bound."""

    def __init__(
        self,
        engine: sa.Engine,
        *,
        holder: str | None = None,
        lease: float = 60.0,
        dispatch: float = DEFAULT_DISPATCH_TIMEOUT,
    ) -> None:
        super().__init__(engine, holder=holder, lease=lease, dispatch=dispatch)
        self.batches = Batches(self)
        self.caps = Caps(engine)

    def register_holder(self, *, pids: list[int] | None = None, now: datetime | None = None) -> None:
        """Record this process as a holder (the worker's first ledger call at start); ``pids``: the processes
        that may run its bodies (main and pool). A database without the ledger's tables raises
        :class:`SchemaMissing`, which says to run ``celery keyed migrate``. Warns when the server runs with
        settings under which the ledger's commits are not durable (``session.server_unsafe_settings``)."""
        machine = machine_identity()

        def work(conn: sa.Connection) -> list[str]:
            holders_register(conn, self.holder, machine=machine, pids=pids, now=now)
            return server_unsafe_settings(conn)

        with schema_required(self.engine):
            unsafe = self.transaction(work)
        if unsafe:
            logger.warning(
                "celery-keyed: the ledger's PostgreSQL runs with %s: a crash may lose the ledger's commits (parked"
                " tasks whose messages are already acknowledged, claims, outcomes) or corrupt it; keep them on in"
                " production",
                " and ".join(f"{name}=off" for name in unsafe),
            )

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

    def configure(
        self, limits: Mapping[str, NameConfig], *, version: int = 0, now: datetime | None = None
    ) -> list[Promotion]:
        """Store the names' configuration as configuration version ``version`` (``keyed_config_version``; a worker
        does this at start) and record the version this holder runs. Rolling deploys: a name
        stored by a newer version is kept as it is (guarded in SQL, ``names.NAMES_UPSERT``), and this is logged:
        the worker runs older configuration. Equal versions overwrite, as without versions. Returns the promotions
        a raised limit made."""

        def work(conn: sa.Connection) -> Configured:
            done = configure_names(conn, limits, version=version, dispatch=self.dispatch, now=now)
            holders_set_config_version(conn, self.holder, version)
            return done

        with schema_required(self.engine):
            done = self.transaction(work)
            self.caps.refresh()
        if done.kept or done.newest_version > version:
            logger.warning(
                "celery-keyed: this worker runs configuration version %d, older than version %d stored in the ledger"
                " by a newer worker: its limits are kept%s",
                version,
                done.newest_version,
                f" for {', '.join(done.kept)}" if done.kept else "",
            )
        return done.promotions

    def config_versions(self) -> tuple[int, list[sa.Row[Any]]]:
        """The newest configuration version stored, and the latest start of each hostname with the version it runs
        (``holders.HOLDERS_LATEST``)."""
        with schema_required(self.engine), self.engine.connect() as conn:
            return names_newest_version(conn), holders_latest(conn)

    @staticmethod
    def parks_at_receipt(arrival: Arrival) -> bool:
        """Whether ``park_at_receipt`` decides ``arrival`` (a plain arrival: one key, no group, no not-before, cost
        1, no supersede key); it answers None for any other."""
        return admit.plain(arrival)

    def admit(self, arrival: Arrival, *, now: datetime | None = None) -> Admission:
        """Admit ``arrival`` or park it (``batches.Batches.admit``): the fast claim, ``keyed_admit_plain`` or the
        general transaction (``admit.admit``), whichever decides it first. A key of a capped name takes a slot of
        its name's cap too (``caps.Caps.apply``)."""
        return self.batches.admit(self._capped(arrival), now=now)

    def park_at_receipt(self, arrival: Arrival, *, now: datetime | None = None) -> Admission | None:
        """Park ``arrival`` as soon as it is received when its key has a line or no room (PARKED, or REJECTED when
        its waiting room is full); None: left to its admission (``batches.Batches.park_at_receipt``). Never takes a
        slot (D3)."""
        return self.batches.park_at_receipt(self._capped(arrival), now=now)

    def admit_many(self, arrivals: Sequence[Arrival], *, now: datetime | None = None) -> list[Admission]:
        """Admit or park a batch of arrivals: one Admission per arrival, in input order, each its own verdict (as
        ``admit`` would give it), FIFO within a key (D10); a value the database refuses rejects its arrival only
        (``batches.Batches.admit_many``)."""
        return self.batches.admit_many([self._capped(a) for a in arrivals], now=now)

    def park_many_at_receipt(
        self, arrivals: Sequence[Arrival], *, now: datetime | None = None
    ) -> list[Admission | BaseException | None]:
        """``park_at_receipt`` for a batch, in one round trip; per arrival its answer or the exception its own call
        raised (``batches.Batches.park_many_at_receipt``)."""
        return self.batches.park_many_at_receipt([self._capped(a) for a in arrivals], now=now)

    def _capped(self, arrival: Arrival) -> Arrival:
        """``arrival`` with its names' cap keys (``caps.Caps.apply``; the capped names read at most every few
        seconds)."""
        return self.caps.apply(arrival)

    def bind(self, token: Token, nonce: uuid.UUID, *, now: datetime | None = None) -> int | None:
        """Bind a promotion by its nonce (D5): one guarded, self-committing statement; its fence, or None."""
        return self.autocommitted(
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
        """Release a claim and promote what the freed room makes ready, in one self-committing call with or
        without waiters (``batches.Batches.release``). ``local_queues`` / ``local_tasks``: the caller runs
        promotions of these itself (D4); ``uncertain`` / ``hold``: the attempt ended by a hard time limit or a lost
        worker."""
        return self.batches.release(
            token, fence, outcome, detail=detail, contended=contended, local_queues=local_queues,
            local_tasks=local_tasks, uncertain=uncertain, hold=hold, now=now,
        )

    def release_many(self, releases: Sequence[ReleaseRequest], *, now: datetime | None = None) -> list[ReleaseReport]:
        """Release a batch of claims: one ReleaseReport per request, in input order, each as ``release`` would give
        it; N releases cost one round trip where they can (``batches.Batches.release_many``)."""
        return self.batches.release_many(releases, now=now)

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

    def cancel_requested(self, held: Iterable[HeldClaim]) -> dict[HeldClaim, str]:
        """Of ``held`` (claims this holder renews), those whose cancellation a newer arrival asked for (newest wins,
        ``on_newer="cancel_running"``), with who asked. One read."""
        held = list(held)
        if not held:
            return {}
        with self.engine.connect() as conn:
            return claims_cancel_requested(conn, self.holder, held)

    def confirm(self, token: Token, fence: int, *, now: datetime | None = None) -> bool:
        """Bind a start to a claim taken earlier (D14): True when the claim of ``token`` is still this holder's,
        running, with ``fence`` (its lease renewed); False when it lapsed or was taken back. One
        self-committing statement."""
        with self.autocommit_connection() as conn:
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
        (its body ended but its release never committed, D15): ``completed`` or ``failed``; or ``revoked`` (Celery
        discarded it as revoked after its claim had gone back)."""
        if outcome not in (TaskOutcome.COMPLETED, TaskOutcome.FAILED, TaskOutcome.REVOKED):
            raise ValueError(f"a task is settled as completed, failed or revoked, not {outcome!r}")
        final = TaskOutcome(outcome)
        return self.transaction(
            lambda conn: outcomes.settle(conn, task_id, final, detail=detail, dispatch=self.dispatch, now=now)
        )

    def revoke(self, task_id: str, *, now: datetime | None = None) -> list[Promotion]:
        return self.transaction(lambda conn: revoke.revoke(conn, task_id, dispatch=self.dispatch, now=now))

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

    def take_never_ran(
        self, task_ids: list[str] | None = None, *, limit: int = 500
    ) -> AbstractContextManager[NeverRan]:
        """A context manager: the never-ran rows whose failure result is not stored yet, locked for the caller while
        it stores them (``never_ran.take_never_ran``: ``task_ids``, else the sweep's oldest ``limit``)."""
        return take_never_ran(self.engine, task_ids, limit=limit)

    def captured_keys(self, names: list[str]) -> list[sa.Row[Any]]:
        """Per name, the keys seen while it was a K = 1 identity (prefix capture, DESIGN §3.11)."""
        with self.engine.connect() as conn:
            return keys_captured_by(conn, names)

    def ping(self) -> None:
        """One round trip: raises the driver's error when the ledger's database cannot be reached (the breaker's
        probe, D9)."""
        with self.engine.connect() as conn:
            conn.execute(PING)


