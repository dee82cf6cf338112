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

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

import psycopg
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError, IntegrityError

from celery_keyed.ledger import admit, outcomes, overrides, promote, reconcile, release, revoke
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
from celery_keyed.ledger.books import (
    books_balance,
    books_mark_notified,
    books_open_idle,
    books_reject_unkeyable,
    books_unnotified,
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
from celery_keyed.ledger.claims import HeldClaim, claims_cancel_requested, claims_renew
from celery_keyed.ledger.errors import (
    MAX_TASK_ID_LENGTH,
    InvalidConfig,
    InvalidKey,
    LedgerError,
    SchemaMissing,
    WrongState,
    on_handle_error,
    translate,
)
from celery_keyed.ledger.explain import Explanation, explain
from celery_keyed.ledger.fair_weights import (
    FAIR_WEIGHT_MAX,
    FAIR_WEIGHT_MIN,
    FairShare,
    check_prefix,
    check_weight,
    clear_fair_weight,
    fair_shares,
    fair_weight_overrides,
    set_fair_weight,
)
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
from celery_keyed.ledger.identity import ClaimHolding, FailoverLedger, watch_engine
from celery_keyed.ledger.key_overrides import (
    KeyOverride,
    clear_key_limit,
    key_override_get,
    key_overrides_live,
    pause_key,
    resume_key,
    set_key_limit,
)
from celery_keyed.ledger.keys import keys_captured_by
from celery_keyed.ledger.keyspec import MAX_KEYS_PER_CALL, key_name, normalize_key, validate_name, validate_task_id
from celery_keyed.ledger.migrations import applied_versions, migrate, schema_missing, schema_required
from celery_keyed.ledger.names import Configured, NameConfig, configure_names, names_newest_version, parse_limits
from celery_keyed.ledger.outbox import (
    MissingRetry,
    OutboxCounts,
    OutboxDue,
    outbox_by_name,
    outbox_register,
    outbox_register_retry,
    outbox_take_due,
)
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
from celery_keyed.ledger.release import FastReleases
from celery_keyed.ledger.sent import SendCounts, SendVerdict, sent_admit, sent_by_name, sent_forget
from celery_keyed.ledger.session import per_transaction, server_unsafe_settings, settings_in_effect, startup_options
from celery_keyed.ledger.status import (
    KeyStatus,
    NameStatus,
    limited_names_sql,
    name_limit_sql,
    status_key_count,
    status_keys,
    status_names,
    status_now,
    status_prepare,
)

__all__ = [
    "COST_MAX",
    "DEFAULT_DISPATCH_TIMEOUT",
    "DEFAULT_RESERVE_TIMEOUT",
    "EXCLUSIVE_COST",
    "FAIR_WEIGHT_MAX",
    "FAIR_WEIGHT_MIN",
    "INT_MAX",
    "MAX_KEYS_PER_CALL",
    "MAX_TASK_ID_LENGTH",
    "SECONDS_MAX",
    "SLOT_LIMIT_MAX",
    "STATEMENT_TIMEOUT_MAX",
    "Admission",
    "Arrival",
    "ClaimHolding",
    "Explanation",
    "FailoverLedger",
    "FairShare",
    "HeldClaim",
    "InvalidConfig",
    "InvalidKey",
    "KeyOverride",
    "KeyStatus",
    "Ledger",
    "LedgerError",
    "LocalHandoff",
    "MissingRetry",
    "NameConfig",
    "NameStatus",
    "OutboxCounts",
    "OutboxDue",
    "Outcome",
    "Promotion",
    "ReleaseReport",
    "ReleaseRequest",
    "Report",
    "SchemaMissing",
    "SendCounts",
    "SendVerdict",
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
    "check_debounce",
    "check_int",
    "check_on_newer",
    "check_prefix",
    "check_seconds",
    "check_weight",
    "claims_renew",
    "clear_fair_weight",
    "clear_key_limit",
    "clear_override",
    "configure_names",
    "drop_idle_keys_once",
    "explain",
    "fair_shares",
    "fair_weight_overrides",
    "groups_register",
    "holders_latest",
    "key_name",
    "key_override_get",
    "key_overrides_live",
    "keys_captured_by",
    "limited_names_sql",
    "migrate",
    "name_limit_sql",
    "names_newest_version",
    "new_holder",
    "normalize_key",
    "outbox_by_name",
    "outbox_register",
    "outbox_register_retry",
    "override_get",
    "parse_limits",
    "pause_key",
    "per_transaction",
    "prune_books_once",
    "reclaim_once",
    "reconcile_once",
    "resume_key",
    "schema_missing",
    "sent_admit",
    "sent_by_name",
    "set_fair_weight",
    "set_key_limit",
    "set_override",
    "settings_in_effect",
    "startup_options",
    "status_key_count",
    "status_keys",
    "status_names",
    "status_now",
    "status_prepare",
    "sweep_once",
    "validate_name",
    "validate_task_id",
]

T = TypeVar("T")

#: How many keys a Ledger remembers as "the fast claim admitted the last arrival here" (Ledger._fast_keys).
FAST_KEYS = 10_000

logger = logging.getLogger("celery_keyed")

#: ping: the cheapest round trip, the breaker's probe that the ledger's database answers (D9).
PING = sa.text("SELECT 1")

#: SQLSTATEs that mean "nothing happened, run the transaction again".
_RETRYABLE = {"40P01", "40001"}  # deadlock_detected, serialization_failure

#: What one element of a batch may fail with without failing the others: a value the database refuses (a NUL
#: character, an integer out of range, a violated constraint) or one the driver cannot send. An unreachable database
#: (OperationalError, InterfaceError) and a missing schema (ProgrammingError) fail the whole batch.
_REFUSED: tuple[type[BaseException], ...] = (
    sa.exc.DataError,
    sa.exc.IntegrityError,
    InvalidConfig,
    WrongState,
    TypeError,
    ValueError,
)


def _sqlstate(exc: DBAPIError) -> str | None:
    return getattr(getattr(exc.orig, "diag", None), "sqlstate", None) or getattr(exc.orig, "sqlstate", None)


def _refused_detail(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    return f"refused by the ledger's database: {text[0] if text else type(orig).__name__}"


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
        if not sa.event.contains(engine, "handle_error", on_handle_error):
            sa.event.listen(engine, "handle_error", on_handle_error)  # PostgreSQL's own limits are data errors
        watch_engine(engine, lease=lease)  # D20: a new connection's first contact with a server checks its identity
        #: The same pool in autocommit: the single-statement fast paths need no BEGIN / COMMIT round trips.
        self.autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self.holder = holder or new_holder()
        self.lease = lease
        self.dispatch = dispatch
        #: Keys whose last admission here was the fast claim (insertion order = age, at most FAST_KEYS): a plain
        #: arrival of any other key — its first use here, or one whose last fast claim found no room or a line —
        #: goes straight to ``keyed_admit_plain``, which decides it in one call where the fast claim would miss
        #: first (two round trips).
        self._fast_keys: dict[str, None] = {}
        self._fast_keys_lock = threading.Lock()
        #: Per thread: the autocommit connection a service thread keeps between its calls (``pinned``).
        self._pins = threading.local()

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """While the context is open, this thread's self-committing calls (``autocommitted``, the fast claim,
        ``confirm``) reuse one connection of the pool instead of checking one out and back in for each call.

        For the worker's service threads (admission, receipt, releaser), which make such a call per keyed task:
        the checkout, the isolation level set on it and reset on its return, cost about 75 µs of the worker's main
        process CPU per call, a third of a call's client CPU. The connection goes back to the pool when the context
        ends, and is dropped (the next call takes another from the pool) as soon as a call finds it broken or
        invalidated (the database restarted, a network error): each thread then fails at most one call on a dead
        connection, which the callers already retry like any call that lost the database."""
        if getattr(self._pins, "depth", 0):
            self._pins.depth += 1
            try:
                yield
            finally:
                self._pins.depth -= 1
            return
        self._pins.depth = 1
        self._pins.conn = None
        try:
            yield
        finally:
            self._pins.depth = 0
            conn, self._pins.conn = self._pins.conn, None
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()

    @contextlib.contextmanager
    def _autocommit_connection(self) -> Iterator[sa.Connection]:
        """A connection in autocommit: this thread's pinned one (``pinned``), else one checked out for the call."""
        if not getattr(self._pins, "depth", 0):
            with self.autocommit.connect() as conn:
                yield conn
            return
        conn = self._pins.conn
        if conn is None or conn.closed or conn.invalidated:
            self._drop_pin()
            conn = self._pins.conn = self.autocommit.connect()
        try:
            yield conn
        except BaseException:
            if conn.invalidated or conn.closed:
                self._drop_pin()
            raise
        finally:
            if self._pins.conn is conn and conn.in_transaction():
                # SQLAlchemy's autobegin (a statement run through conn.execute); nothing is open on the server
                # in autocommit, and ending it keeps the next call from running inside it.
                try:
                    conn.rollback()
                except Exception:
                    self._drop_pin()

    def _drop_pin(self) -> None:
        conn, self._pins.conn = self._pins.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

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
                if _sqlstate(exc) not in _RETRYABLE or attempt == attempts - 1:
                    raise
                time.sleep(0.001 * (2**attempt))
        raise AssertionError("unreachable")

    def autocommitted(self, work: Callable[[sa.Connection], T], *, attempts: int = 5) -> T:
        """Run ``work(conn)`` on a connection in autocommit (each statement its own transaction: a server-side path
        is one call, one round trip); retried like ``transaction`` on deadlock or serialization failure, which
        roll the failed statement back. ``work`` must be one statement, or statements each safe alone."""
        for attempt in range(attempts):
            try:
                with self._autocommit_connection() as conn:
                    return work(conn)
            except DBAPIError as exc:
                if _sqlstate(exc) not in _RETRYABLE or attempt == attempts - 1:
                    raise
                time.sleep(0.001 * (2**attempt))
        raise AssertionError("unreachable")

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
        does this at start) and record the version this holder runs. Rolling deploys (issue 14 item 7): a name
        stored by a newer version is kept as it is (guarded in SQL, ``names.NAMES_UPSERT``), and this is logged:
        the worker runs older configuration. Equal versions overwrite, as without versions. Returns the promotions
        a raised limit made."""

        def work(conn: sa.Connection) -> Configured:
            done = configure_names(conn, limits, version=version, dispatch=self.dispatch, now=now)
            holders_set_config_version(conn, self.holder, version)
            return done

        with schema_required(self.engine):
            done = self.transaction(work)
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

    def admit_at_send(
        self,
        task_id: str,
        key: str,
        *,
        dedupe_key: str | None = None,
        arrival_timeout: float = 3600.0,
        now: datetime | None = None,
    ) -> SendVerdict:
        """Refusal at send (issue 14 item 3): one self-committing call of ``keyed_admit_at_send`` before a producer
        publishes ``task_id`` under ``key`` (its first concurrency key). Accepted: the task id's place in the key's
        waiting room (and its dedupe key) is reserved. Refused (``room_full``: the waiting room plus the sends
        not parked yet reach ``max_waiting``; ``duplicate``: the dedupe key is live in another task): nothing is
        reserved or booked. Decided inside Postgres under locks, so concurrent senders never over-fill the room
        (see ``ledger/sent.py``)."""
        with schema_required(self.engine):
            return self.autocommitted(
                lambda conn: sent_admit(
                    conn, task_id, key, dedupe_key=dedupe_key, arrival_timeout=arrival_timeout, now=now
                )
            )

    def forget_send(self, task_id: str) -> None:
        """Give back the place of a send accepted but never published (its publish raised)."""
        self.transaction(lambda conn: sent_forget(conn, task_id))

    def sends(self, *, now: datetime | None = None) -> list[SendCounts]:
        """Per name: sends accepted and not arrived yet, and the sends refused (room full, duplicate)."""
        with schema_required(self.engine), self.engine.connect() as conn:
            return sent_by_name(conn, now=now)

    def register_at_publish(
        self,
        task_id: str,
        message: dict[str, Any],
        *,
        task_name: str = "",
        key: str | None = None,
        group_key: str | None = None,
        eta: datetime | None = None,
        arrival_timeout: float = 3600.0,
        now: datetime | None = None,
    ) -> bool:
        """The outbox (issue 14 item 8): store ``task_id``'s message, committed when this returns, before the
        producer publishes it — one self-committing INSERT, one round trip. True when stored; False when the task id
        had already arrived or was registered (``ledger/outbox.py``)."""
        with schema_required(self.engine):
            return self.autocommitted(
                lambda conn: outbox_register(
                    conn, task_id, message, task_name=task_name, key=key, group_key=group_key, eta=eta,
                    arrival_timeout=arrival_timeout, now=now,
                )
            )

    def register_retry(
        self,
        task_id: str,
        attempt: int,
        message: dict[str, Any] | None,
        *,
        task_name: str = "",
        key: str | None = None,
        group_key: str | None = None,
        eta: datetime | None = None,
        arrival_timeout: float = 3600.0,
        now: datetime | None = None,
    ) -> bool:
        """Register retry number ``attempt`` of ``task_id`` before it is published, committed when this returns:
        with its ``message`` (the outbox is on: the relay publishes it again if the attempt does not arrive in
        time), or None (reconcile reports it). True when stored (``outbox.outbox_register_retry``)."""
        with schema_required(self.engine):
            return self.autocommitted(
                lambda conn: outbox_register_retry(
                    conn, task_id, attempt, message, task_name=task_name, key=key, group_key=group_key, eta=eta,
                    arrival_timeout=arrival_timeout, now=now,
                )
            )

    def outbox_due(
        self,
        *,
        arrival_timeout: float,
        grouped_timeout: float | None = None,
        batch: int = 100,
        now: datetime | None = None,
    ) -> list[OutboxDue]:
        """Take the registrations no worker received in time (and those registered in a caller's transaction,
        not published yet), committed, for the caller to publish (``outbox.outbox_take_due``)."""
        return self.transaction(
            lambda conn: outbox_take_due(
                conn, arrival_timeout=arrival_timeout, grouped_timeout=grouped_timeout, batch=batch, now=now
            )
        )

    def outbox(self) -> list[OutboxCounts]:
        """Per name: registrations not received yet, and how often the relay published them again."""
        with schema_required(self.engine), self.engine.connect() as conn:
            return outbox_by_name(conn)

    def admit(self, arrival: Arrival, *, now: datetime | None = None) -> Admission:
        """Admit ``arrival`` or park it (see ``admit.admit``). A first arrival with one key and room is one
        self-committing statement (``fast_paths.CLAIM_NEW``); a plain arrival that found no room is admitted or
        parked by one more call (``keyed_admit_plain``); everything else runs the general transaction."""
        key = arrival.key
        if key is not None and admit.plain(arrival) and not self._fast_key(key):
            decided = self._admit_after_fast(arrival, fresh=False, now=now)
            if decided.verdict is Verdict.ADMITTED:
                self._remember_fast_key(key, True)
            return decided
        with self._autocommit_connection() as conn:
            fast, fresh = admit.admit_autocommit(conn, arrival, holder=self.holder, lease=self.lease, now=now)
        if key is not None:
            self._remember_fast_key(key, fast is not None)
        if fast is not None:
            return fast
        return self._admit_after_fast(arrival, fresh=fresh, now=now)

    def _fast_key(self, key: str) -> bool:
        with self._fast_keys_lock:
            return key in self._fast_keys

    def _remember_fast_key(self, key: str, fast: bool) -> None:
        with self._fast_keys_lock:
            self._fast_keys.pop(key, None)
            if fast:
                self._fast_keys[key] = None
                if len(self._fast_keys) > FAST_KEYS:
                    del self._fast_keys[next(iter(self._fast_keys))]

    def _admit_after_fast(self, arrival: Arrival, *, fresh: bool, now: datetime | None) -> Admission:
        """The rest of an admission whose fast claim did not admit it (``fresh``: that claim recorded the task's
        first arrival)."""
        if admit.plain(arrival):
            decided, new = self.autocommitted(
                lambda conn: admit.admit_plain(conn, arrival, holder=self.holder, lease=self.lease, now=now)
            )
            if decided is not None:
                return decided
            fresh = fresh or new
        return self._admit_general(arrival, fresh=fresh, now=now)

    def _admit_general(self, arrival: Arrival, *, fresh: bool, now: datetime | None) -> Admission:
        """The general transaction (``admit.admit``) for an arrival no fast path decided."""
        return self.transaction(
            lambda conn: admit.admit(
                conn, arrival, holder=self.holder, lease=self.lease, fresh=fresh, dispatch=self.dispatch, now=now
            )
        )

    @staticmethod
    def parks_at_receipt(arrival: Arrival) -> bool:
        """Whether ``park_at_receipt`` decides ``arrival`` (a plain arrival: one key, no group, no not-before, cost
        1, no supersede key); it answers None for any other."""
        return admit.plain(arrival)

    def park_at_receipt(self, arrival: Arrival, *, now: datetime | None = None) -> Admission | None:
        """Park ``arrival`` as soon as it is received when its key has a line or no room — one self-committing
        call (``keyed_admit_or_park_plain``, park only): PARKED, or REJECTED when its waiting room is full. None:
        left to its admission once a pool process is ready for it (room and no line; or not a plain arrival: one
        key, no group, no not-before, cost 1, no supersede key). Never takes a slot (D3)."""
        if not admit.plain(arrival):
            return None
        return self.autocommitted(
            lambda conn: admit.park_plain(conn, arrival, holder=self.holder, lease=self.lease, now=now)
        )

    def admit_many(self, arrivals: Sequence[Arrival], *, now: datetime | None = None) -> list[Admission]:
        """Admit or park a batch of arrivals: one Admission per arrival, in input order, each its own verdict (as
        ``admit`` would give it).

        Arrivals with one key, no group and no not-before time are claimed together in one call
        (``keyed_claim_many``: task rows locked in task id order, then slot rows in key order, so two batches never
        deadlock): N uncontended arrivals on keys seen before cost one round trip. The others — and any the call
        did not admit (no room, a known task, a key's first use) — are then decided one by one in input order, each
        in its own transaction, as ``admit`` decides them. FIFO within a key (D10): an arrival is never admitted
        ahead of an earlier arrival of the same key in the batch (once one of a key is not admitted by the call,
        the later ones of that key are not tried there either).

        One arrival whose values the database refuses (a NUL character, an integer out of range, a violated
        constraint) does not fail the others: it gets ``Verdict.REJECTED`` with a ``detail`` starting "refused by
        the ledger's database", booked as rejected when its task id can be stored (``books_reject_unkeyable``; the
        caller stores its KeyedRejected result, as for any rejection; "(not booked)" is appended when even that
        failed). An unreachable database (sqlalchemy OperationalError / InterfaceError) or a missing schema raises
        for the whole batch; arrivals decided before the error are committed (their claims are reclaimed by the
        reaper if the caller cannot use them, their parked rows are kept)."""
        arrivals = list(arrivals)
        answers: list[Admission | None] = [None] * len(arrivals)
        fresh = [False] * len(arrivals)
        tried = [False] * len(arrivals)
        batch: list[int] = []
        behind: set[str] = set()  # keys with an earlier arrival that is decided on its own (FIFO, D10)
        for i, arrival in enumerate(arrivals):
            if admit.batchable(arrival) and arrival.key not in behind:
                batch.append(i)
            else:
                behind.update(arrival.keys)
        if batch:
            chosen = [arrivals[i] for i in batch]
            try:
                decided = self.autocommitted(
                    lambda conn: admit.claim_many(conn, chosen, holder=self.holder, lease=self.lease, now=now)
                )
            except _REFUSED:
                decided = None  # one value refused fails the call (nothing committed): decide each on its own
            if decided is not None:
                for i, (admission, new) in zip(batch, decided, strict=True):
                    answers[i], fresh[i], tried[i] = admission, new, True
        general = [False] * len(arrivals)
        rest = [i for i in range(len(arrivals)) if answers[i] is None]
        plain_rest: list[int] = []
        for i in rest:
            if not admit.plain(arrivals[i]):
                break
            plain_rest.append(i)
        if len(plain_rest) > 1:
            # The plain ones left up to the first that is not (no room seen, a key's first use): one round trip, one
            # transaction each (keyed_admit_plain_many), in input order up to the first it leaves undecided; that one
            # and everything after it are decided below, in input order — so parked rows are numbered in input
            # order, as one-by-one calls number them.
            chosen = [arrivals[i] for i in plain_rest]
            try:
                decisions = self.autocommitted(
                    lambda conn: admit.admit_plain_many(
                        conn, chosen, holder=self.holder, lease=self.lease, park_only=False, in_order=True, now=now
                    ),
                    attempts=1,
                )
            except _REFUSED:
                decisions = None  # one value refused fails the call before any arrival: decide each on its own
            if decisions is not None:
                for i, decision in zip(plain_rest, decisions, strict=True):
                    fresh[i] = fresh[i] or decision.new
                    if decision.admission is not None:
                        answers[i] = decision.admission
                    elif decision.verdict == "general":
                        general[i] = True
        for i, arrival in enumerate(arrivals):
            if answers[i] is None:
                if general[i]:
                    answers[i] = self._admit_general(arrival, fresh=fresh[i], now=now)
                else:
                    answers[i] = self._admit_isolated(arrival, tried=tried[i], fresh=fresh[i], now=now)
        return [a for a in answers if a is not None]

    def park_many_at_receipt(
        self, arrivals: Sequence[Arrival], *, now: datetime | None = None
    ) -> list[Admission | BaseException | None]:
        """``park_at_receipt`` for a batch, in one round trip (keyed_admit_plain_many with park only: one transaction
        per arrival, in input order). Per arrival, as ``park_at_receipt`` answers: PARKED / REJECTED, or None (left
        to its admission at pool-ready), or the exception its own call raised. Once one of a key is left alone, the
        later ones of that key are left alone too (never parked ahead of it, D10). An unreachable database raises
        for the whole batch (arrivals parked before the error stay parked; a redelivery is recognised, D8)."""
        arrivals = list(arrivals)
        answers: list[Admission | BaseException | None] = [None] * len(arrivals)
        chosen = [i for i, arrival in enumerate(arrivals) if admit.plain(arrival)]
        if not chosen:
            return answers
        if len(chosen) == 1:
            decisions = None
        else:
            try:
                decisions = self.autocommitted(
                    lambda conn: admit.admit_plain_many(
                        conn, [arrivals[i] for i in chosen], holder=self.holder, lease=self.lease, park_only=True,
                        now=now,
                    ),
                    attempts=1,
                )
            except _REFUSED:
                decisions = None  # refused before any arrival was decided: each on its own, below
        if decisions is None:
            for i in chosen:
                try:
                    answers[i] = self.park_at_receipt(arrivals[i], now=now)
                except Exception as exc:
                    answers[i] = exc
            return answers
        for i, decision in zip(chosen, decisions, strict=True):
            if decision.admission is not None and decision.admission.verdict in (Verdict.PARKED, Verdict.REJECTED):
                answers[i] = decision.admission
            elif decision.verdict == "error":
                try:  # its statement was rolled back: on its own, so that its error is raised as usual
                    answers[i] = self.park_at_receipt(arrivals[i], now=now)
                except Exception as exc:
                    answers[i] = exc
        return answers

    def _admit_isolated(self, arrival: Arrival, *, tried: bool, fresh: bool, now: datetime | None) -> Admission:
        try:
            if tried:
                return self._admit_after_fast(arrival, fresh=fresh, now=now)
            return self.admit(arrival, now=now)
        except _REFUSED as exc:
            detail = _refused_detail(exc)
            try:
                self.transaction(
                    lambda conn: books_reject_unkeyable(
                        conn, arrival.task_id, task_name=arrival.task_name, detail=detail, now=now
                    )
                )
            except _REFUSED:
                detail += " (not booked)"
            return Admission(Verdict.REJECTED, detail=detail)

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
        """Release a claim and promote what the freed room makes ready: one self-committing call
        (``keyed_release_and_promote``: the release, the waiter check after it (D2) and the promotion of a plain
        line, in one transaction, so the freed slot is never visible to anyone else, a sweeper included) — one round
        trip with or without waiters. A line whose head is not plain (a group, several keys, a fair or rated name)
        and the shadows of the attempt (D8) are finished in one more transaction. ``contended`` is accepted and no
        longer changes the path (every release promotes in its own call). ``local_queues`` / ``local_tasks``: the
        caller runs promotions of these itself (D4); they come back already bound to this holder
        (``Promotion.nonce is None``). ``uncertain`` / ``hold``: the attempt ended by a hard time limit or a lost
        worker; an uncertain hold keeps its slots (see ``release.release``)."""
        request = ReleaseRequest(
            token,
            fence,
            outcome,
            detail=detail,
            contended=contended,
            local_queues=None if local_queues is None else frozenset(local_queues),
            local_tasks=None if local_queues is None else frozenset(local_tasks or ()),
            uncertain=uncertain,
            hold=hold,
        )
        return self._release_batch([request], isolate=False, now=now)[0]

    def release_many(self, releases: Sequence[ReleaseRequest], *, now: datetime | None = None) -> list[ReleaseReport]:
        """Release a batch of claims: one ReleaseReport per request, in input order, each as ``release`` would give
        it (idempotent and fenced: a stale or repeated one is ``released=False``).

        Claims without a group that did not end uncertain or by a lost worker are released together in one call
        (``keyed_release_and_promote``: claim and task rows token by token in (task id, attempt) order, then every
        slot row in (key, shard) order, then the head rows of the keys with waiters in key order), which also reads
        which keys have waiters (D2) and promotes their plain lines (FIFO, D10) in the same transaction: N releases
        cost one round trip, with or without promotions. Lines whose head is not plain and shadows (D8) are
        finished in one more transaction. The other requests (grouped, uncertain, lost, or nothing to release) are
        then decided one by one, as ``release`` decides them.
        Promotions are reported by the first request (in input order) that gave a slot back on their key; a
        request's ``local_queues`` / ``local_tasks`` make promotions local (D4) when every request with waiters
        in the batch has the same ones (one local run per such request), else they are all dispatched with nonces.
        One request whose values the database refuses gets ``released=False`` and a ``detail``; an unreachable
        database raises for the whole batch (what was committed before stays committed: a release may be
        repeated safely)."""
        return self._release_batch(list(releases), isolate=True, now=now)

    def _local(self, request: ReleaseRequest) -> LocalHandoff | None:
        if request.local_queues is None:
            return None
        return LocalHandoff(
            holder=self.holder, lease=self.lease, queues=request.local_queues, tasks=request.local_tasks or frozenset()
        )

    def _release_general(self, request: ReleaseRequest, *, now: datetime | None) -> ReleaseReport:
        """One release through the general transaction (``release.release``)."""
        local = self._local(request)
        return self.transaction(
            lambda conn: release.release(
                conn,
                request.token,
                request.fence,
                request.outcome,
                detail=request.detail,
                dispatch=self.dispatch,
                local=local,
                uncertain=request.uncertain,
                hold=request.hold,
                now=now,
            )
        )

    def _release_batch(
        self, requests: list[ReleaseRequest], *, isolate: bool, now: datetime | None
    ) -> list[ReleaseReport]:
        reports: list[ReleaseReport | None] = [None] * len(requests)
        batch = [i for i, r in enumerate(requests) if release.batchable(r)]
        if batch:
            chosen = [requests[i] for i in batch]
            done: FastReleases | None
            try:
                done = self.autocommitted(
                    lambda conn: release.release_and_promote(
                        conn, chosen, holder=self.holder, lease=self.lease, dispatch=self.dispatch, now=now
                    )
                )
            except _REFUSED:
                if not isolate:
                    raise
                done = None  # one value refused fails the call (nothing committed): decide each on its own
            if done is not None:
                promotions = done.promotions + self._after_fast_releases(chosen, done, now=now)
                self._settle_fast_releases(requests, batch, done.rows, promotions, reports)
        for i, request in enumerate(requests):
            if reports[i] is None:
                if not isolate:
                    reports[i] = self._release_general(request, now=now)
                    continue
                try:
                    reports[i] = self._release_general(request, now=now)
                except _REFUSED as exc:
                    reports[i] = ReleaseReport(released=False, detail=_refused_detail(exc))
        return [r for r in reports if r is not None]

    def _after_fast_releases(
        self, chosen: list[ReleaseRequest], done: FastReleases, *, now: datetime | None
    ) -> list[Promotion]:
        """What ``keyed_release_and_promote`` left, in one transaction when there is any (none in the common case):
        the shadows of released attempts (D8) and the lines whose head is not plain (a group, several keys, a
        reservation, a fair or rated name), promoted by ``promote_each_key`` into the rooms the call reported on
        their keys. Local handoff (D4) as in the call: when every request with a room names the same set, up to
        one run here per such request, counting those the call bound already."""
        shadows = [
            (request.token, row.key, request.outcome)
            for request, row in zip(chosen, done.rows, strict=True)
            if row.released and row.has_shadow
        ]
        general = set(done.general)
        rooms = [
            (key, shard)
            for row in done.rows
            for key, shard in zip(row.room_keys, row.room_shards, strict=True)
            if key in general
        ]
        if not shadows and not rooms:
            return []
        with_room = [request for request, row in zip(chosen, done.rows, strict=True) if row.room_keys]
        named = {None if r.local_queues is None else (r.local_queues, r.local_tasks or frozenset()) for r in with_room}
        local = None
        if len(named) == 1 and None not in named and sum(p.nonce is None for p in done.promotions) < len(with_room):
            queues, tasks = next(iter(named))  # type: ignore[misc]
            local = LocalHandoff(holder=self.holder, lease=self.lease, queues=queues, tasks=tasks)
        return self.transaction(
            functools.partial(
                release.after_release_many, shadows=shadows, rooms=rooms, dispatch=self.dispatch, local=local, now=now
            )
        )

    def _settle_fast_releases(
        self,
        requests: list[ReleaseRequest],
        batch: list[int],
        rows: list[Any],
        promotions: list[Promotion],
        reports: list[ReleaseReport | None],
    ) -> None:
        """Reports of the requests the batch call released, with the promotions their rooms made."""
        owner: dict[str, int] = {}  # key -> index of the first request that gave back a slot on it with waiters
        for i, row in zip(batch, rows, strict=True):
            if not row.released:
                continue
            request = requests[i]
            final = outcomes.final_outcome(request.outcome, grouped=False)
            reports[i] = ReleaseReport(
                released=True, finished=[(request.token.task_id, final)] if row.recorded and final else []
            )
            for key in row.room_keys:
                owner.setdefault(key, i)
        # A promotion is reported by the request that gave back a slot on its key; a multi-key waiter's promotion
        # (reported under its first key) may come from a room on another of its keys: then by the first request
        # that gave back a room with waiters. Never by a request the batch call did not release (a grouped
        # claim, a stale fence): a report made up for it would skip its own release (the general path below),
        # leaving its claim until its lease lapsed and its group stalled (found in the demo: a group head's retry
        # batched with a tenant+api release; the group waited a lease, then for reconcile).
        fallback = next(iter(owner.values()), batch[0])
        for promotion in promotions:
            report = reports[owner.get(promotion.key or "", fallback)]
            assert report is not None, "a promotion comes from the room of a released row"
            report.promotions.append(promotion)

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

    def warm_up(self) -> bool:
        """Open this thread's connection and run the hot path once on it, rolled back: claims, an arrival parked
        behind one of them, a release that promotes it and one that finds nobody waiting, and the fast claim.

        A new backend compiles the ledger's PL/pgSQL functions and plans their statements on first use (and loads
        the catalog entries of every table they touch); together with the connection's own start that made the
        first handoff of a fresh worker 30-60 ms slower than the next ones (docs/benchmarks.md). The worker's
        service threads call it in their pinned context (``pinned``) once the worker received its first keyed task.
        Everything runs in one explicit transaction block that is rolled back, on keys of a name of its own
        (``keyed-warm-up-<random>``), so nothing is left behind and no lock of another name or key is taken; only
        the fence sequence may move on. Never raises: a ledger that cannot be reached is the breaker's business when a
        real call finds it. True when the whole path ran (claimed, parked, released and promoted)."""
        try:
            with self._autocommit_connection() as conn:
                raw = conn.connection.driver_connection
                if not isinstance(raw, psycopg.Connection) or not raw.autocommit:
                    return False
                raw.execute("BEGIN")
                try:
                    # a name of its own (the name's rows, inserted and rolled back, would make two threads warming
                    # up at once wait for each other)
                    name = f"keyed-warm-up-{uuid.uuid4().hex[:16]}"
                    key, other = f"{name}:1", f"{name}:2"
                    first, second, third, fourth = (
                        Arrival(task_id=f"{k}:{n}", key=k, task_name="keyed.warm_up", queue="keyed.warm_up")
                        for k, n in ((key, 1), (key, 2), (other, 3), (other, 4))
                    )
                    queues = tasks = frozenset({"keyed.warm_up"})
                    # a key's first arrival (keyed_admit_plain), one parked behind it, the release that promotes
                    # it; another key's first arrival, its release with nobody waiting, then the fast claim of a
                    # known key with room (CLAIM_NEW)
                    claimed, _ = admit.admit_plain(conn, first, holder=self.holder, lease=self.lease)
                    parked, _ = admit.admit_plain(conn, second, holder=self.holder, lease=self.lease)
                    alone, _ = admit.admit_plain(conn, third, holder=self.holder, lease=self.lease)
                    if claimed is None or parked is None or alone is None:
                        return False
                    done = release.release_and_promote(
                        conn,
                        [
                            ReleaseRequest(Token(t.task_id, 0), a.fence or 0, Outcome.COMPLETED,
                                           local_queues=queues, local_tasks=tasks)
                            for t, a in ((first, claimed), (third, alone))
                        ],
                        holder=self.holder, lease=self.lease,
                    )
                    fast, _ = admit.admit_autocommit(conn, fourth, holder=self.holder, lease=self.lease)
                    return (
                        parked.verdict is Verdict.PARKED
                        and [p.task_id for p in done.promotions] == [second.task_id]
                        and fast is not None
                        and fast.verdict is Verdict.ADMITTED
                    )
                finally:
                    if not raw.closed:
                        raw.execute("ROLLBACK")
        except Exception:
            logger.debug("celery-keyed: warming the ledger connection up failed", exc_info=True)
            if getattr(self._pins, "depth", 0):
                self._drop_pin()  # whatever state it was left in, the next call starts on a fresh connection
            return False

    def confirm(self, token: Token, fence: int, *, now: datetime | None = None) -> bool:
        """Bind a start to a claim taken earlier (D14): True when the claim of ``token`` is still this holder's,
        running, with ``fence`` (its lease renewed); False when it lapsed or was taken back. One
        self-committing statement."""
        with self._autocommit_connection() as conn:
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

    def set_fair_weight(
        self,
        name: str,
        prefix: str,
        weight: float,
        *,
        reason: str,
        author: str = "",
        expires_at: datetime | None = None,
        now: datetime | None = None,
    ) -> None:
        """Set the runtime weight of the fair keys of ``name`` matching ``prefix`` (ledger/fair_weights.py), audited;
        it takes effect at the next promotion of each key (it makes no room, so it promotes nothing)."""
        with schema_required(self.engine):
            self.transaction(
                lambda conn: set_fair_weight(
                    conn, name, prefix, weight, reason=reason, author=author, expires_at=expires_at, now=now
                )
            )

    def clear_fair_weight(
        self, name: str, prefix: str, *, reason: str = "", author: str = "", now: datetime | None = None
    ) -> bool:
        with schema_required(self.engine):
            return self.transaction(
                lambda conn: clear_fair_weight(conn, name, prefix, reason=reason, author=author, now=now)
            )

    def fair_shares(
        self, *, name: str | None = None, key: str | None = None, limit: int = 200, now: datetime | None = None
    ) -> list[FairShare]:
        with schema_required(self.engine), self.engine.connect() as conn:
            return fair_shares(conn, name=name, key=key, limit=limit, now=now)

    def promote_key(self, key: str, *, now: datetime | None = None) -> list[Promotion]:
        return self.transaction(lambda conn: promote.promote_key(conn, key, dispatch=self.dispatch, now=now))

    # -- key overrides (issue 14 item 4: a key that throttles itself; ledger/key_overrides.py) -------------------

    def set_key_limit(
        self,
        key: str,
        limit: int,
        *,
        reason: str,
        author: str = "",
        expires_at: datetime | None = None,
        expires_in: float | None = None,
        now: datetime | None = None,
    ) -> list[Promotion]:
        """Give ``key`` a limit of its own (its name's no longer applies to it) until ``expires_at`` / for
        ``expires_in`` seconds (neither: until cleared), audited; the promotions a raised limit made."""
        with schema_required(self.engine):
            return self.transaction(
                lambda conn: set_key_limit(
                    conn, key, limit, reason=reason, author=author, expires_at=expires_at, expires_in=expires_in,
                    dispatch=self.dispatch, now=now,
                )
            )

    def clear_key_limit(
        self, key: str, *, reason: str = "", author: str = "", now: datetime | None = None
    ) -> list[Promotion] | None:
        """Remove the key's own limit (its name's applies again); None when it had none."""
        with schema_required(self.engine):
            return self.transaction(
                lambda conn: clear_key_limit(conn, key, reason=reason, author=author, dispatch=self.dispatch, now=now)
            )

    def pause_key(
        self,
        key: str,
        seconds: float | None = None,
        *,
        until: datetime | None = None,
        reason: str,
        author: str = "",
        now: datetime | None = None,
    ) -> tuple[datetime, bool]:
        """Pause ``key`` (not its name) for ``seconds`` or until ``until``: nothing new of it starts before then,
        running attempts go on, its waiters keep their places. Only ever extends a pause. (End of the pause in force,
        whether this call set it.)"""
        with schema_required(self.engine):
            return self.transaction(
                lambda conn: pause_key(conn, key, seconds, until=until, reason=reason, author=author, now=now)
            )

    def resume_key(
        self, key: str, *, reason: str = "", author: str = "", now: datetime | None = None
    ) -> list[Promotion] | None:
        """End the pause of ``key`` now; its waiters are promoted (returned). None when it was not paused."""
        with schema_required(self.engine):
            return self.transaction(
                lambda conn: resume_key(conn, key, reason=reason, author=author, dispatch=self.dispatch, now=now)
            )

    def key_override(self, key: str, *, now: datetime | None = None) -> KeyOverride | None:
        """The override of ``key`` in force now (its own limit, its pause), or None."""
        with schema_required(self.engine), self.engine.connect() as conn:
            return key_override_get(conn, key, now=now)

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
