"""The ledger's batch policy: how arrivals are admitted or parked, one or many at a time, and how claims are
released, one or many — which server-side path decides each and in what order, so that a batch costs one round trip
where it can and each element still gets the answer it would get alone.

:class:`Batches` runs on a :class:`~celery_keyed.ledger.session.LedgerSession` (the ``Ledger`` facade builds one
and forwards ``admit``, ``admit_many``, ``park_at_receipt``, ``park_many_at_receipt``, ``release`` and
``release_many`` to it). It keeps one piece of state of its own: the keys whose last admission here was the fast
claim (``FastKeys``).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import admit, call_limits, outcomes, release
from celery_keyed.ledger.attempts import (
    Admission,
    Arrival,
    Outcome,
    Promotion,
    ReleaseReport,
    ReleaseRequest,
    Token,
    Verdict,
)
from celery_keyed.ledger.books import books_reject_unkeyable
from celery_keyed.ledger.errors import InvalidConfig, WrongState
from celery_keyed.ledger.promote import LocalHandoff
from celery_keyed.ledger.release import FastReleases
from celery_keyed.ledger.session import LedgerSession

#: How many keys a ledger remembers as "the fast claim admitted the last arrival here" (``FastKeys``).
FAST_KEYS = 10_000

#: What one element of a batch may fail with without failing the others: a value the database refuses (a NUL
#: character, an integer out of range, a violated constraint) or one the driver cannot send. An unreachable database
#: (OperationalError, InterfaceError) and a missing schema (ProgrammingError) fail the whole batch.
REFUSED: tuple[type[BaseException], ...] = (
    sa.exc.DataError,
    sa.exc.IntegrityError,
    InvalidConfig,
    WrongState,
    TypeError,
    ValueError,
)


def refused_detail(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    return f"refused by the ledger's database: {text[0] if text else type(orig).__name__}"


class FastKeys:
    """Keys whose last admission here was the fast claim (insertion order = age, at most ``FAST_KEYS``): a plain
    arrival of any other key — its first use here, or one whose last fast claim found no room or a line — goes
    straight to ``keyed_admit_plain``, which decides it in one call where the fast claim would miss first (two round
    trips). Thread-safe."""

    def __init__(self, size: int = FAST_KEYS) -> None:
        self.size = size
        self._keys: dict[str, None] = {}
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._keys

    def remember(self, key: str, fast: bool) -> None:
        with self._lock:
            self._keys.pop(key, None)
            if fast:
                self._keys[key] = None
                if len(self._keys) > self.size:
                    del self._keys[next(iter(self._keys))]


class _BatchState:
    """What ``admit_many`` knows of each arrival of its batch, by input position: its answer so far, whether a call
    recorded its first arrival (``fresh``), whether the batch claim tried it (``tried``), whether it needs the
    general transaction (``general``)."""

    def __init__(self, arrivals: list[Arrival]) -> None:
        self.arrivals = arrivals
        self.answers: list[Admission | None] = [None] * len(arrivals)
        self.fresh = [False] * len(arrivals)
        self.tried = [False] * len(arrivals)
        self.general = [False] * len(arrivals)


class Batches:
    """The admission and release policy of one ledger session (see the module docstring)."""

    def __init__(self, session: LedgerSession) -> None:
        self.session = session
        self.fast_keys = FastKeys()
        self.transaction = session.transaction
        self.autocommitted = session.autocommitted

    # The session's holder, lease and dispatch timeout, read where they are kept.
    @property
    def holder(self) -> str:
        return self.session.holder

    @property
    def lease(self) -> float:
        return self.session.lease

    @property
    def dispatch(self) -> float:
        return self.session.dispatch

    def admit(self, arrival: Arrival, *, now: datetime | None = None) -> Admission:
        """Admit ``arrival`` or park it (see ``admit.admit``). A first arrival with one key and room is one
        self-committing statement (``fast_paths.CLAIM_NEW``); a plain arrival that found no room is admitted or
        parked by one more call (``keyed_admit_plain``); everything else runs the general transaction. An arrival
        that carries a limit from its call stores it first (``call_limits.store_first``)."""
        before = self._store_call_limits([arrival], now=now).get(0)
        decided = self._admit_one(arrival, now=now)
        return decided if not before else dataclasses.replace(decided, promotions=(*before, *decided.promotions))

    def _store_call_limits(self, arrivals: Sequence[Arrival], *, now: datetime | None) -> dict[int, list[Promotion]]:
        """The limits the arrivals carry, stored before any of them is decided, and the promotions a new limit made
        (by input position: ``call_limits.store_first``)."""
        if all(a.call_limit is None for a in arrivals):
            return {}
        try:
            return self.transaction(
                lambda conn: call_limits.store_first(conn, arrivals, dispatch=self.dispatch, now=now)
            )
        except REFUSED:
            pass  # one value the database refuses fails the statement: store each on its own, skipping that one
        stored: dict[int, list[Promotion]] = {}
        for i, arrival in enumerate(arrivals):
            if arrival.call_limit is None:
                continue
            store_one = functools.partial(call_limits.store_first, arrivals=[arrival], dispatch=self.dispatch, now=now)
            try:
                one = self.transaction(store_one)
            except REFUSED:
                continue  # its own decision refuses it again, and records why
            if 0 in one:
                stored[i] = one[0]
        return stored

    def _admit_one(self, arrival: Arrival, *, now: datetime | None = None) -> Admission:
        key = arrival.key
        if key is not None and admit.plain(arrival) and key not in self.fast_keys:
            decided = self._admit_after_fast(arrival, fresh=False, now=now)
            if decided.verdict is Verdict.ADMITTED:
                self.fast_keys.remember(key, True)
            return decided
        with self.session.autocommit_connection() as conn:
            fast, fresh = admit.admit_autocommit(conn, arrival, holder=self.holder, lease=self.lease, now=now)
        if key is not None:
            self.fast_keys.remember(key, fast is not None)
        if fast is not None:
            return fast
        return self._admit_after_fast(arrival, fresh=fresh, now=now)

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
        ``admit`` would give it). The limits the arrivals carry from their calls are stored first, in one
        transaction (``call_limits.store_first``): the batch is decided under the limits its latest arrivals set.

        Arrivals with one key, no group and no not-before time are claimed together in one call
        (``keyed_claim_many``: task rows locked in task id order, then slot rows in key order, so two batches never
        deadlock): N uncontended arrivals cost one round trip (a single-shard name's new keys included: their rows are
        created in the call). The others — and any the call did not admit (no room, a known task, the first use of a
        key of a sharded name) — are then decided one by one in input order, each in its own transaction, as
        ``admit`` decides them. FIFO within a key (D10): an arrival is never admitted
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
        before = self._store_call_limits(arrivals, now=now)
        state = _BatchState(arrivals)
        self._claim_together(state, now=now)
        self._admit_plain_in_order(state, now=now)
        for i, arrival in enumerate(arrivals):
            if state.answers[i] is None:
                if state.general[i]:
                    state.answers[i] = self._admit_general(arrival, fresh=state.fresh[i], now=now)
                else:
                    state.answers[i] = self._admit_isolated(
                        arrival, tried=state.tried[i], fresh=state.fresh[i], now=now
                    )
        for i, promoted in before.items():  # the room a new limit from the call made, carried by its arrival's answer
            answer = state.answers[i]
            if answer is not None:
                state.answers[i] = dataclasses.replace(answer, promotions=(*promoted, *answer.promotions))
        return [a for a in state.answers if a is not None]

    def _claim_together(self, state: _BatchState, *, now: datetime | None) -> None:
        """The first step of ``admit_many``: the arrivals with one key, no group and no not-before time, claimed in
        one call (``keyed_claim_many``) — up to the first of each key that is decided on its own (FIFO, D10)."""
        arrivals = state.arrivals
        batch: list[int] = []
        behind: set[str] = set()  # keys with an earlier arrival that is decided on its own (FIFO, D10)
        for i, arrival in enumerate(arrivals):
            if admit.batchable(arrival) and arrival.key not in behind:
                batch.append(i)
            else:
                behind.update(arrival.keys)
        if not batch:
            return
        chosen = [arrivals[i] for i in batch]
        try:
            decided = self.autocommitted(
                lambda conn: admit.claim_many(conn, chosen, holder=self.holder, lease=self.lease, now=now)
            )
        except REFUSED:
            return  # one value refused fails the call (nothing committed): decide each on its own
        for i, (admission, new) in zip(batch, decided, strict=True):
            state.answers[i], state.fresh[i], state.tried[i] = admission, new, True

    def _admit_plain_in_order(self, state: _BatchState, *, now: datetime | None) -> None:
        """The second step of ``admit_many``: the plain arrivals left, up to the first that is not (no room seen, a
        key's first use), in one round trip, one transaction each (``keyed_admit_plain_many``), in input order up
        to the first it leaves undecided; that one and everything after it are decided one by one, in input order —
        so parked rows are numbered in input order, as one-by-one calls number them."""
        arrivals = state.arrivals
        plain_rest: list[int] = []
        for i in (i for i in range(len(arrivals)) if state.answers[i] is None):
            if not admit.plain(arrivals[i]):
                break
            plain_rest.append(i)
        if len(plain_rest) <= 1:
            return
        chosen = [arrivals[i] for i in plain_rest]
        try:
            decisions = self.autocommitted(
                lambda conn: admit.admit_plain_many(
                    conn, chosen, holder=self.holder, lease=self.lease, park_only=False, in_order=True, now=now
                ),
                attempts=1,
            )
        except REFUSED:
            return  # one value refused fails the call before any arrival: decide each on its own
        for i, decision in zip(plain_rest, decisions, strict=True):
            state.fresh[i] = state.fresh[i] or decision.new
            if decision.admission is not None:
                state.answers[i] = decision.admission
            elif decision.verdict == "general":
                state.general[i] = True

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
            except REFUSED:
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
        except REFUSED as exc:
            detail = refused_detail(exc)
            try:
                self.transaction(
                    lambda conn: books_reject_unkeyable(
                        conn, arrival.task_id, task_name=arrival.task_name, detail=detail, now=now
                    )
                )
            except REFUSED:
                detail += " (not booked)"
            return Admission(Verdict.REJECTED, detail=detail)


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
            except REFUSED:
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
                except REFUSED as exc:
                    reports[i] = ReleaseReport(released=False, detail=refused_detail(exc))
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

