"""The consumer gate: admission of keyed requests, release of their slots, dispatch of promotions, the lease
heartbeat (D7), the due-time sweeper (D2) and the circuit breaker (D9). One ``GateService`` per worker
process, owned by the ``KeyedGate`` consumer bootstep (bootstep.py).

Threads: admission runs on the consumer's loop thread (one short transaction, bounded by
``keyed_statement_timeout``); releases are handed to a releaser thread, so a release's commit (and the
promotion it makes) never holds up the loop; the heartbeat and the sweeper run on threads of their own, so a
busy or blocked loop (``--pool=solo``) never lets a lease lapse. Each thread takes its connections from the
ledger's pool. Promotions found off the loop that this worker runs itself go back to the loop (``_to_loop``)
and wake it through a pipe its hub reads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from celery.exceptions import TaskRevokedError
from celery.worker import state as worker_state
from celery.worker.strategy import default as default_strategy

from celery_keyed import exceptions, metrics, signals
from celery_keyed.engine import create_ledger_engine
from celery_keyed.ledger import (
    Admission,
    Arrival,
    HeldClaim,
    InvalidKey,
    Ledger,
    Outcome,
    Promotion,
    ReleaseReport,
    ReleaseRequest,
    Token,
    Verdict,
    books_mark_notified,
    books_reject_unkeyable,
    books_unnotified,
    bounds,
    keys_captured_by,
    new_holder,
    normalize_key,
    reclaim_once,
)
from celery_keyed.messages import context_from_record, record_message, republish, restore_message
from celery_keyed.settings import KeyedSettings
from celery_keyed.task import (
    HEADER_COST,
    HEADER_FAIR,
    HEADER_GROUP,
    HEADER_GROUP_SEQ,
    HEADER_KEY,
    HEADER_NONCE,
    HEADER_SUPERSEDE,
    check_cost,
    evaluate_key,
    evaluate_keys,
    key_spec,
)
from celery_keyed.worker.admission import AdmissionService, Job

logger = logging.getLogger("celery_keyed")

_current: GateService | None = None

#: Seconds after a key last parked or promoted an attempt during which its releases promote in the same
#: transaction (no window where the freed slot is visible to another worker's sweeper).
_CONTENDED_FOR = 5.0


#: Most releases the releaser thread gives back in one ``Ledger.release_many``.
_RELEASE_BATCH = 64

#: Errors that mean "the ledger cannot be reached now" (the breaker opens, the request is held, D9), as opposed
#: to the ledger refusing a message's data (a recorded rejection, D16).
_UNREACHABLE: tuple[type[BaseException], ...] = (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError)

#: The ledger's integer columns (attempt numbers, priorities: integer; group sequence numbers: bigint).
_INT_MAX = bounds.INT_MAX
_BIGINT_MAX = bounds.BIGINT_MAX


def _unkeyable(exc: BaseException) -> str:
    """The recorded detail of a message whose keys could not be computed or admitted (D16)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"keys could not be computed or admitted: {type(exc).__name__}{': ' + text[:300] if text else ''}"


def current_gate() -> GateService | None:
    """The gate of this worker process, or None outside a worker with ``install(app)``."""
    return _current


def keyed_strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Callable[..., Any]:
    """Task strategy of keyed tasks: Celery's default strategy. The gate acts through the request class
    (``KeyedRequest``), when the pool is ready to start the request (D3); receipt itself is Celery's: revoked
    and expired messages are dropped by it, unkeyed calls pass through untouched."""
    return default_strategy(task, app, consumer, **kwargs)


class _Unreachable(Exception):
    """The ledger could not be reached; the breaker is open (D9)."""


@dataclass
class _Running:
    request: Any
    token: Token
    fence: int
    fenced: bool = False  # self-fencing already acted on it
    claimed_at: float = field(default_factory=time.monotonic)


@dataclass
class _Prebound:
    """A promotion bound to this worker in its releaser's transaction (D4), whose request waits for a pool
    process. Its claim is renewed like a running one (D13); it is confirmed by a guarded statement when it
    starts (D14), and given back when it has waited too long (the line must not stay pinned to a busy pool)."""

    fence: int
    key: str | None
    since: float = field(default_factory=time.monotonic)


@dataclass
class _Release:
    """A release handed by the consumer loop to the releaser thread (everything read on the loop)."""

    token: Token
    fence: int
    outcome: Outcome
    key: str | None
    name: str
    contended: bool
    local_queues: list[str] | None
    local_tasks: list[str] | None
    uncertain: bool
    hold: Any
    released_at: float
    after: Callable[[], None] | None = None  # the broker ack, deferred until the release commits (D15)


class GateService:
    """The gate of one worker process."""

    def __init__(self, app: Any, consumer: Any, settings: KeyedSettings) -> None:
        self.app = app
        self.consumer = consumer
        self.settings = settings
        self.engine = create_ledger_engine(settings)
        self.ledger = Ledger(
            self.engine,
            holder=new_holder(getattr(consumer, "hostname", None)),
            lease=settings.lease,
            dispatch=settings.dispatch_timeout,
        )
        self._lock = threading.Lock()
        self._running: dict[Token, _Running] = {}
        self._pending_releases: deque[_Release] = deque()
        self._pending_revokes: deque[str] = deque()  # revokes not yet stored (ledger unreachable)
        self._held: deque[Any] = deque()  # requests waiting for the ledger to come back (D9)
        self._prebound: dict[Token, _Prebound] = {}  # promotions bound to us at promotion time (D4); under _lock
        self._to_loop: deque[Promotion] = deque()  # promotions found off the loop, to start on it (D4)
        self._loop_calls: deque[Callable[[], None]] = deque()  # work for the loop thread (deferred broker acks)
        self._contended: dict[str, float] = {}  # key -> when it last parked or promoted (monotonic)
        self._breaker_open = False
        self._cancelled_queues: list[str] = []  # keyed-only queues not consumed while the breaker is open (D9)
        self._waker: tuple[Any, int, int] | None = None  # (hub, read fd, write fd): threads wake the loop
        self._reachable_since = time.monotonic()
        self._last_reclaim = 0.0
        self._last_gone_check = time.monotonic()
        self._last_renewal = time.monotonic()
        self._stop = threading.Event()  # the consumer-bound threads (sweeper, releaser) stop
        self._closed = False  # shutdown began: no local handoff; the heartbeat ends with the last tracked claim
        self._heartbeat_exit = threading.Event()  # end the heartbeat now (tests, interpreter exit)
        self._heartbeat: threading.Thread | None = None
        self._pids: list[int] = []  # this process and its pool processes, as last recorded in the ledger
        self._loop_thread: int | None = None  # the consumer loop's thread (events are sent from it only)
        self._handoff_strategies: dict[str, tuple[Any, Any, Any]] = {}  # task name -> (strategy, dispatcher, ours)
        self._releases: deque[_Release] = deque()  # for the releaser thread
        self._release_ready = threading.Event()
        self._release_lock = threading.Lock()
        self._releaser_accepting = False  # a releaser thread runs and takes new releases
        self._threads: list[threading.Thread] = []
        self._timers: list[Any] = []
        # Admission off the loop (worker/admission.py): on when the pool semaphore keeps a pool process for a
        # request while its admission is decided (prefork on the event loop); else admission runs on the loop.
        self._admission: AdmissionService | None = None
        self._pool_release: Callable[[], None] | None = None
        self._generation = 0  # consumer starts: a decision handed back after a restart is stale

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        global _current
        _current = self
        self._loop_thread = threading.get_ident()  # Celery starts the consumer's steps on its loop thread
        metrics.serve(self.settings)  # keyed_metrics_port: once per process
        gone = None
        try:
            self._pids = self._process_ids()
            self.ledger.register_holder(pids=self._pids)
            self._warn_prefix_capture()
            self.ledger.configure(self.settings.limits)
            gone = self.ledger.reclaim_gone_predecessors()
        except sa.exc.OperationalError as exc:
            self._open_breaker(exc)
        if gone is not None and gone.reclaimed:
            logger.warning(
                "celery-keyed: gave back %d claims of earlier worker starts on this machine whose processes are gone",
                len(gone.reclaimed),
            )
            self.dispatch(gone.promotions, local=False)
        self._stop.clear()
        self._closed = False
        if self._heartbeat is None or not self._heartbeat.is_alive():
            # D13: the heartbeat belongs to the process, not to the consumer: it goes on through consumer
            # restarts (broker reconnects) and warm shutdown, as long as a body it tracks may run.
            self._last_renewal = time.monotonic()
            self._heartbeat_exit.clear()
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="keyed-heartbeat", daemon=True)
            self._heartbeat.start()
        for target, name in (
            (self._sweep_loop, "keyed-sweeper"),
            (self._release_loop, "keyed-releaser"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        with self._release_lock:
            self._releaser_accepting = True
        self._generation += 1
        timer = getattr(self.consumer, "timer", None)
        hub = getattr(self.consumer, "hub", None)
        if hub is not None:
            self._attach_waker(hub)
        self._pool_release = self._pool_semaphore_release()
        if hub is not None and self._pool_release is not None and self.settings.admission_batch > 0:
            if self._admission is None:
                self._admission = AdmissionService(self._decide, self._deliver, batch=self.settings.admission_batch)
            self._admission.start()
        if timer is not None:
            self._timers.append(timer.call_repeatedly(self.settings.probe_interval, self._resubmit_held))
            if hub is None:  # a polling transport (no event loop to wake): drain on a short timer
                self._timers.append(timer.call_repeatedly(0.01, self._drain_to_loop))

    def stop(self) -> None:
        """Stop what belongs to the consumer: the sweeper, the releaser, the loop's timers and wakeup. Celery
        calls it on every broker reconnect and at warm shutdown while the pool still runs tasks, so the
        heartbeat (renewal and self-fencing) goes on (D13), and running attempts keep their claims (their outcome
        hooks release them). Safe to call twice (it runs from signal handlers). The releaser finishes the
        releases handed to it; later ones run in the caller's thread."""
        self._stop.set()
        if self._admission is not None:
            self._admission.stop()  # decides what was handed over; the loop's part (below) gives it back
        with self._release_lock:
            self._releaser_accepting = False
        self._release_ready.set()
        for entry in self._timers:
            with contextlib.suppress(Exception):
                entry.cancel()
        self._timers.clear()
        if self._waker is not None:
            with contextlib.suppress(Exception):
                self._waker[0].remove_reader(self._waker[1])
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads.clear()
        self._run_loop_calls()  # acks the releaser deferred until its commits (stop runs on the loop thread)

    def shutdown(self) -> None:
        """Worker shutdown (warm: the pool may still run keyed tasks). Promotions bound here that have not
        started go back in line for other workers, later promotions are published instead of run here (this
        worker takes no new work), and the heartbeat goes on renewing the running attempts until the last one
        has ended (D13). Safe to call twice."""
        global _current
        self._closed = True
        self.stop()
        self._give_back_prebound(lambda p: True, "the worker is shutting down")
        self._flush_pending_releases()
        if _current is self:
            _current = None
        waker, self._waker = self._waker, None
        if waker is not None:  # the threads are stopped: nobody writes to it any more
            for fd in waker[1:]:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def close(self) -> None:
        """Shut down and end the heartbeat now, whatever it still tracks (tests; a process that owns no
        running body any more)."""
        self.shutdown()
        self._heartbeat_exit.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        self.engine.dispose()

    def _warn_prefix_capture(self) -> None:
        """§3.11: configuring a name turns every ``name:*`` key from a mutex into a gate. Runs before the
        configuration is stored, and says so for each name the ledger has seen keys of while they were K = 1
        identities (unconfigured, or configured as 1) and that is now configured with another limit."""
        names = sorted(n for n, c in self.settings.limits.items() if c.limit != 1)
        if not names:
            return
        with self.engine.connect() as conn:
            rows = keys_captured_by(conn, names)
        for row in rows:
            limit = self.settings.limits[row.name].limit
            logger.warning(
                "celery-keyed: name %r is now configured with limit %d: its %d known keys (e.g. %r) were mutexes "
                "(K = 1) until now; every %s:* key is a gate of %d from here on",
                row.name,
                limit,
                row.n,
                row.example,
                row.name,
                limit,
            )

    # -- admission (consumer loop thread) --------------------------------------------------------------

    def is_keyed(self, request: Any) -> bool:
        headers = request._request_dict
        if any(h in headers for h in (HEADER_KEY, HEADER_GROUP)):
            return True
        task = request.task
        return key_spec(task, "concurrency_key") is not None or key_spec(task, "group_key") is not None

    def execute(self, request: Any, submit: Callable[[], Any]) -> Any:
        """Admit ``request`` now that a pool process can start it: run it, or park / drop it and free the
        pool slot (raising ``TaskRevokedError`` makes Celery release its pool semaphore, nothing else).

        Every start is bound by one guarded statement now (D14): an ordinary admission, the bind of a
        promotion's nonce, or the confirmation of a promotion bound here earlier (D4) whose claim must still be
        this worker's with the same fence. Whatever the message holds, nothing raises into the consumer loop
        (D16): what cannot be computed or admitted is a recorded rejection with a ``KeyedRejected`` result."""
        try:
            arrival = self.arrival_for(request)
        except Exception as exc:  # D16: anything computed from the message (keys, headers, integers)
            detail = f"malformed keys: {exc}" if isinstance(exc, InvalidKey) else _unkeyable(exc)
            self._finish_without_running(request, "rejected", detail, record_in_ledger=True)
            metrics.admission("rejected")
            raise TaskRevokedError(request.id) from None
        if arrival is None:  # this call carries no key after all: Celery's own path
            return submit()
        if request.id in worker_state.revoked:
            # Celery's own check, made before admission: a revoked request takes no slot. (Celery would discard
            # it right after we claimed one, leaving the claim unused until the never-started sweep.) A promotion
            # meant for it is taken and given back as revoked, so that it does not go back in line.
            if arrival.token not in self._prebound and not self._breaker_open:
                with contextlib.suppress(*_UNREACHABLE):
                    fence = self._bind_promoted(request, arrival)
                    if fence is not None:
                        with self._lock:
                            self._prebound[arrival.token] = _Prebound(fence, arrival.key)
            self._revoked_before_start(arrival.token, arrival.key)
            request.revoked()  # Celery's bookkeeping: ack, REVOKED result, task_revoked signal
            raise TaskRevokedError(request.id)
        if self._breaker_open:
            self._hold(request)
            raise TaskRevokedError(request.id)
        request.keyed_arrival_key = arrival.key
        admission_service = self._admission
        if admission_service is not None and admission_service.submit(
            Job(request, arrival, submit, extra={"generation": self._generation})
        ):
            return None  # decided off the loop; the pool semaphore stays taken for it until then
        try:
            fence, admission = self._claim(request, arrival)
        except _UNREACHABLE as exc:
            self._open_breaker(exc)
            self._hold(request)
            raise TaskRevokedError(request.id) from None
        except Exception as exc:  # D16: the ledger refused the message's data (a value out of range...)
            self._refused(request, exc)
            raise TaskRevokedError(request.id) from None
        if not self._conclude(request, arrival, fence, admission):
            raise TaskRevokedError(request.id)
        return submit()

    def _claim(self, request: Any, arrival: Arrival) -> tuple[int | None, Admission | None]:
        """The ledger's part of an admission (any thread): confirm a promotion bound here earlier (D14), bind a
        promotion's nonce (D5), or admit the arrival. (fence, None) for a bound promotion, else (None, admission)."""
        fence = self._start_prebound(arrival.token)
        if fence is None:
            fence = self._bind_promoted(request, arrival)
        if fence is not None:
            return fence, None
        return None, self.ledger.admit(arrival)

    def _refused(self, request: Any, exc: BaseException) -> None:
        info = (type(exc), exc, exc.__traceback__)
        logger.error("celery-keyed: could not admit %s[%s]", request.name, request.id, exc_info=info)
        self._finish_without_running(request, "rejected", _unkeyable(exc), record_in_ledger=True)
        metrics.admission("rejected")

    def _conclude(self, request: Any, arrival: Arrival, fence: int | None, admission: Admission | None) -> bool:
        """Loop thread: act on a decided admission. True: the request holds a slot (``fence``) and is tracked;
        the caller starts it. False: parked, dropped or refused (acked and announced here)."""
        metrics.started(arrival.token, None if admission is None else admission.verdict)
        if admission is None and arrival.key is not None:  # bound a promotion: the key has a line
            self._contended[arrival.key] = time.monotonic()
        if admission is not None and admission.promotions:  # waiters ahead of it started with the room it found
            self.dispatch(list(admission.promotions), local=True)
        if admission is not None:
            if admission.verdict is Verdict.ADMITTED:
                fence = admission.fence
            else:
                self._not_admitted(request, admission)
                return False
        assert fence is not None
        self._track(request, arrival.token, fence)
        request._request_dict["keyed_fence"] = fence  # the task reads it (self.request.keyed_fence, D7)
        return True

    def _track(self, request: Any, token: Token, fence: int) -> None:
        """Any thread: ``request`` holds the claim (token, fence); the heartbeat renews it from now on."""
        if request.keyed_claim == (token, fence):
            return
        request.keyed_claim = (token, fence)
        with self._lock:
            self._running[token] = _Running(request, token, fence)

    # -- admission off the loop (celery_keyed/worker/admission.py) ---------------------------------------

    def _decide(self, jobs: Sequence[Job]) -> None:
        """The admission thread: decide a batch. Promotions (bound earlier, or carrying a nonce) are bound one by
        one (a guarded statement each, D14); the ordinary arrivals in one ``admit_many``, in the order they
        reached the pool. A claim is tracked (renewed by the heartbeat) from the moment it is taken."""
        plain: list[Job] = []
        for job in jobs:
            try:
                fence = self._start_prebound(job.arrival.token)
                if fence is None:
                    fence = self._bind_promoted(job.request, job.arrival)
            except Exception as exc:
                job.error = exc
                continue
            if fence is not None:
                job.result = (fence, None)
                self._track(job.request, job.arrival.token, fence)
            else:
                plain.append(job)
        if not plain:
            return
        admissions: list[Admission | None]
        try:
            admissions = list(self._admit_many([job.arrival for job in plain]))
        except _UNREACHABLE as exc:
            for job in plain:
                job.error = exc
            return
        except Exception:  # one message's data refused: decide them one by one, so that only it is refused
            admissions = []
            for job in plain:
                try:
                    admissions.append(self.ledger.admit(job.arrival))
                except Exception as exc:
                    admissions.append(None)
                    job.error = exc
        for job, admission in zip(plain, admissions, strict=True):
            if admission is None:
                continue
            job.result = (None, admission)
            if admission.verdict is Verdict.ADMITTED and admission.fence is not None:
                self._track(job.request, job.arrival.token, admission.fence)

    def _admit_many(self, arrivals: list[Arrival]) -> list[Admission]:
        admit_many = getattr(self.ledger, "admit_many", None)
        if admit_many is not None and len(arrivals) > 1:
            return list(admit_many(arrivals))
        return [self.ledger.admit(arrival) for arrival in arrivals]

    def _deliver(self, jobs: list[Job]) -> None:
        """The admission thread: hand the decided batch to the loop."""
        self._call_on_loop(lambda: self._admitted(jobs))

    def _admitted(self, jobs: list[Job]) -> None:
        """Loop thread: start the admitted requests of a decided batch in the pool processes kept for them; ack,
        park or drop the others and give their pool process back."""
        for job in jobs:
            try:
                self._start_decided(job)
            except Exception:
                logger.exception("celery-keyed: could not act on the admission of %s", job.request.id)

    def _start_decided(self, job: Job) -> None:
        request = job.request
        # The consumer stopped since the hand-over (a broker reconnect, shutdown): Celery has reset its pool
        # semaphore and forgotten the request; its unacked message comes back from the broker.
        stale = self._stop.is_set() or self._closed or job.extra.get("generation") != self._generation
        free = (lambda: None) if stale else self._free_pool_slot
        if job.error is not None:
            free()
            if isinstance(job.error, _UNREACHABLE):
                self._open_breaker(job.error)
                if not stale:
                    self._hold(request)
            else:  # D16: the ledger refused the message's data
                self._refused(request, job.error)
            return
        fence, admission = job.result
        if not self._conclude(request, job.arrival, fence, admission):
            free()
            return
        if stale:
            self._give_back(request, Outcome.WORKER_LOST)
            return
        if request.id in worker_state.revoked:  # revoked while its admission was decided
            self.release(request, Outcome.REVOKED)
            free()
            request.revoked()
            return
        try:
            job.submit()
        except TaskRevokedError:  # Celery's own check: revoked or expired meanwhile
            self.release(request, Outcome.REVOKED)
            free()
        except Exception:
            logger.exception("celery-keyed: could not start %s[%s]", request.name, request.id)
            self.release(request, Outcome.WORKER_LOST)
            free()

    def _give_back(self, request: Any, outcome: Outcome) -> None:
        """Release the claim of a request that will not start here, its promotions published (nothing here
        starts them: the consumer is stopped)."""
        claim, request.keyed_claim = request.keyed_claim, None
        if claim is None:
            return
        with self._lock:
            self._running.pop(claim[0], None)
        self._hand_over(
            claim[0], claim[1], outcome, key=request.keyed_arrival_key, name=request.name, contended=True, on_loop=False
        )

    def _free_pool_slot(self) -> None:
        """Give back the pool semaphore Celery took for a request that does not start after all (what raising
        ``TaskRevokedError`` from ``execute_using_pool`` does on the loop's own path)."""
        if self._pool_release is not None:
            self._pool_release()

    def _pool_semaphore_release(self) -> Callable[[], None] | None:
        """Celery's release of the pool semaphore when the worker guards pool puts with it (prefork on the event
        loop), else None: then admission stays on the loop (no semaphore keeps a pool process for a request
        whose admission is decided elsewhere)."""
        controller = getattr(self.consumer, "controller", None)
        if controller is None or getattr(controller, "semaphore", None) is None:
            return None
        if getattr(controller, "process_task", None) != getattr(controller, "_process_task_sem", None):
            return None
        release = getattr(controller, "_quick_release", None)
        return release if callable(release) else None

    def _start_prebound(self, token: Token) -> int | None:
        """D14: a promotion bound to this worker earlier (D4) starts only if its claim is still this worker's,
        with the same fence (one guarded statement, which also renews the lease). None: not bound here, or its
        claim lapsed while it waited (then it is admitted as usual: the ledger has put it back in line, so this
        copy is a duplicate)."""
        with self._lock:
            prebound = self._prebound.pop(token, None)
        if prebound is None:
            return None
        try:
            confirmed = self.ledger.confirm(token, prebound.fence)
        except _UNREACHABLE:
            with self._lock:
                self._prebound.setdefault(token, prebound)  # held with the request; confirmed when resubmitted
            raise
        if not confirmed:
            logger.warning(
                "celery-keyed: the claim of promoted %s attempt %d lapsed before a pool process could start it; "
                "admitting it as usual",
                token.task_id,
                token.attempt,
            )
            return None
        return prebound.fence

    def arrival_for(self, request: Any) -> Arrival | None:
        """The ledger's view of a request: its token, keys (from headers, else computed from the arguments:
        ``send_task`` sends none), deadline and stored message. Malformed keys raise ``InvalidKey``."""
        # A gate header that is present but null is treated as absent (a foreign producer's ``None``): the keys
        # are then computed from the arguments, never skipped.
        headers = {k: v for k, v in request._request_dict.items() if v is not None}
        task = request.task
        key = headers.get(HEADER_KEY)
        group = headers.get(HEADER_GROUP)
        supersede = headers.get(HEADER_SUPERSEDE)
        if key is None and group is None:
            args, kwargs = tuple(request.args), dict(request.kwargs)
            key = evaluate_keys(key_spec(task, "concurrency_key"), task, args, kwargs)
            group = evaluate_key(key_spec(task, "group_key"), task, args, kwargs, option="group_key")
            supersede = evaluate_key(key_spec(task, "supersede_key"), task, args, kwargs, option="supersede_key")
            fair = evaluate_key(key_spec(task, "fair_key"), task, args, kwargs, option="fair_key")
        else:
            key = _header_keys(key)
            group = None if group is None else normalize_key(group)
            supersede = None if supersede is None else str(supersede)
            fair = headers.get(HEADER_FAIR)
            fair = None if fair is None else normalize_key(fair)
        if key is None and group is None:
            return None
        keys = [key] if isinstance(key, str) else list(key or [])
        cost = check_cost(headers.get(HEADER_COST, getattr(task, "concurrency_cost", 1)), task)
        seq = headers.get(HEADER_GROUP_SEQ)
        if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= _BIGINT_MAX):
            raise InvalidKey(f"header {HEADER_GROUP_SEQ} must be an integer from 0 to {_BIGINT_MAX}, got {seq!r}")
        retries = headers.get("retries") or 0
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= _INT_MAX:
            raise InvalidKey(f"header retries must be an integer from 0 to {_INT_MAX}, got {retries!r}")
        priority = (request.delivery_info or {}).get("priority") or 0
        if isinstance(priority, bool) or not isinstance(priority, int) or not -_INT_MAX <= priority <= _INT_MAX:
            raise InvalidKey(f"message priority must be an integer, got {priority!r}")
        return Arrival(
            task_id=request.id,
            attempt=retries,
            key=keys[0] if keys else None,
            extra_keys=tuple(keys[1:]),
            cost=cost,
            fair_key=fair,
            group_key=group,
            group_seq=seq,
            task_name=request.name,
            priority=int(priority),
            deadline=request._expires,
            supersede_key=supersede,
            queue=(request.delivery_info or {}).get("routing_key"),
            message=record_message(request._message, task_name=request.name),
        )

    def _bind_promoted(self, request: Any, arrival: Arrival) -> int | None:
        nonce = request._request_dict.get(HEADER_NONCE)
        if not nonce:
            return None
        try:
            parsed = uuid.UUID(str(nonce))
        except ValueError:
            logger.warning(
                "celery-keyed: task %s carries a malformed admission token; admitting it as usual", request.id
            )
            return None
        return self.ledger.bind(arrival.token, parsed)  # None: not a live promotion → ordinary admission

    def _not_admitted(self, request: Any, admission: Any) -> None:
        if admission.verdict is Verdict.PARKED:
            key = request.keyed_arrival_key
            if key is not None:
                self._contended[key] = time.monotonic()
            request.acknowledge()  # the parked row is committed: the ledger holds the message now
            worker_state.task_ready(request)
            self._announce_parked(request.id, request.name, key)
            for task_id in admission.superseded:
                self._store_never_ran(task_id, "superseded", f"replaced by {request.id}", None)
        elif admission.verdict is Verdict.DUPLICATE:
            logger.info(
                "celery-keyed: duplicate delivery of %s[%s] dropped (%s)", request.name, request.id, admission.detail
            )
            request.acknowledge()
            worker_state.task_ready(request)
        else:
            self._finish_without_running(request, admission.verdict.value, admission.detail)

    def _finish_without_running(
        self, request: Any, outcome: str, detail: str, *, record_in_ledger: bool = False
    ) -> None:
        """Record (when asked), store the failure result, ack. Never raises: it runs on the consumer loop for
        hostile messages too (D16). A result that could not be stored is stored later from the books (the
        row stays unnotified and the sweeper retries it)."""
        if record_in_ledger:
            with contextlib.suppress(sa.exc.SQLAlchemyError), self.engine.begin() as conn:
                books_reject_unkeyable(conn, request.id, task_name=request.name, detail=detail)
        logger.warning("celery-keyed: %s[%s] %s: %s", request.name, request.id, outcome, detail)
        stored = False
        try:
            exc = exceptions.BY_OUTCOME[outcome](detail)
            request.task.backend.mark_as_failure(request.id, exc, request=request._context, store_result=True)
            stored = True
        except Exception:
            logger.exception("celery-keyed: could not store the %s result of %s", outcome, request.id)
        request.acknowledge()
        worker_state.task_ready(request)
        self._announce_never_ran(request.id, outcome, detail, request.name, getattr(request, "keyed_arrival_key", None))
        if stored:
            with contextlib.suppress(sa.exc.SQLAlchemyError):
                self.ledger.transaction(lambda conn: books_mark_notified(conn, [request.id]))

    # -- release (consumer loop thread, then the releaser thread) ---------------------------------------

    def release(self, request: Any, outcome: Outcome, *, uncertain: bool = False) -> None:
        """Give back the slot of ``request`` after ``outcome``; idempotent (the hooks may fire twice).
        ``uncertain``: a hard time limit or a lost worker ended it; an uncertain hold may keep its slots.

        The loop only forgets the claim and hands the release to the releaser thread, which runs the ledger's
        transaction on a connection of its own (DESIGN §5: a release need not block the consumer loop; a late
        release only keeps the bound stricter for a moment). Its promotions to run here come back to the loop
        (``_to_loop``, with a wakeup) already bound to this worker (D4). Without a running releaser (not
        started, or stopped at shutdown) the release runs in the caller's thread."""
        ack = request.keyed_take_deferred_ack() if hasattr(request, "keyed_take_deferred_ack") else None
        claim = request.keyed_claim
        if claim is None:
            if ack is not None:
                ack()
            return
        request.keyed_claim = None
        token, fence = claim
        with self._lock:
            self._running.pop(token, None)
        key = getattr(request, "keyed_arrival_key", None)
        contended = key is not None and time.monotonic() - self._contended.get(key, -1e9) < _CONTENDED_FOR
        hold = getattr(request.task, "uncertain_hold", None) if uncertain else None
        self._hand_over(
            token,
            fence,
            outcome,
            key=key,
            name=request.name,
            contended=contended,
            uncertain=uncertain,
            hold=hold,
            after=ack,
        )

    def _hand_over(
        self,
        token: Token,
        fence: int,
        outcome: Outcome,
        *,
        key: str | None,
        name: str,
        contended: bool,
        uncertain: bool = False,
        hold: Any = None,
        after: Callable[[], None] | None = None,
        on_loop: bool = True,
    ) -> None:
        """Give the release to the releaser thread, or run it here when none runs (``on_loop``: the caller is
        the consumer loop's thread, which may start a promotion itself). ``after``: the broker ack
        of an ``acks_late`` task, run once the release has committed (D15: a finished body's outcome is in the
        books before its message leaves the broker; a crash in between redelivers a copy the ledger drops)."""
        local_queues, local_tasks = self._local_handoff()
        job = _Release(
            token=token,
            fence=fence,
            outcome=outcome,
            key=key,
            name=name,
            contended=contended,
            local_queues=local_queues,
            local_tasks=local_tasks,
            uncertain=uncertain,
            hold=hold,
            released_at=metrics.clock(),
            after=after,
        )
        with self._release_lock:
            if self._releaser_accepting:
                self._releases.append(job)
                self._release_ready.set()
                return
        local = on_loop and not self._closed
        if not local:  # nobody here can start a promotion bound to us: every promotion is published (D5)
            job.local_queues = job.local_tasks = None
        self._release_now(job, local=local)

    def _release_loop(self) -> None:
        """The releaser thread: runs the releases the loop hands it, in order; on stop, the ones already
        handed over (``stop`` closes the hand-over first, so none is left behind)."""
        while True:
            self._release_ready.wait()
            self._release_ready.clear()
            stopping = self._stop.is_set()
            while self._releases:
                jobs = [self._releases.popleft() for _ in range(min(_RELEASE_BATCH, len(self._releases)))]
                try:
                    self._release_batch(jobs)
                except Exception:
                    logger.exception("celery-keyed: a batch of %d releases failed", len(jobs))
            if stopping:
                return

    def _release_batch(self, jobs: list[_Release]) -> None:
        """The releaser thread: the releases handed over since its last look, in one ``release_many`` (one round
        trip for releases without waiters; the freed rooms with waiters promoted together)."""
        if len(jobs) == 1:
            self._release_now(jobs[0], local=False)
            return
        requests = [
            ReleaseRequest(
                token=job.token,
                fence=job.fence,
                outcome=job.outcome,
                contended=job.contended,
                local_queues=None if job.local_queues is None else frozenset(job.local_queues),
                local_tasks=None if job.local_tasks is None else frozenset(job.local_tasks),
                uncertain=job.uncertain,
                hold=job.hold,
            )
            for job in jobs
        ]
        try:
            reports = self.ledger.release_many(requests)
        except sa.exc.DBAPIError as exc:
            if isinstance(exc, _UNREACHABLE):
                self._open_breaker(exc)
            else:
                logger.exception("celery-keyed: a batch of %d releases failed", len(jobs))
            self._pending_releases.extend(jobs)  # retried by the heartbeat; a release may be repeated safely
            return
        for job, report in zip(jobs, reports, strict=True):
            self._released(job, report, local=False)

    def _release_now(self, job: _Release, *, local: bool) -> None:
        try:
            report = self.ledger.release(
                job.token,
                job.fence,
                job.outcome,
                contended=job.contended,
                local_queues=job.local_queues,
                local_tasks=job.local_tasks,
                uncertain=job.uncertain,
                hold=job.hold,
            )
        except sa.exc.DBAPIError as exc:
            if isinstance(exc, _UNREACHABLE):
                self._open_breaker(exc)
            else:
                logger.exception("celery-keyed: release of %s attempt %d failed", job.token.task_id, job.token.attempt)
            # Kept and retried by the heartbeat: a slot held longer is safe (D9); the ack waits with it (D15).
            self._pending_releases.append(job)
            return
        except Exception:
            logger.exception("celery-keyed: release of %s attempt %d failed", job.token.task_id, job.token.attempt)
            self._after_release(job, local=local)
            return
        self._released(job, report, local=local)

    def _released(self, job: _Release, report: ReleaseReport, *, local: bool) -> None:
        """A release has committed: its deferred ack, its promotions."""
        self._after_release(job, local=local)
        if report.promotions and job.key is not None:
            self._contended[job.key] = time.monotonic()
        for task_id, final in report.finished:
            if final == "dead_lettered":
                logger.error("celery-keyed: group head %s[%s] dead-lettered; its group moves on", job.name, task_id)
        metrics.promoted(report.promotions, job.released_at)
        self.dispatch(report.promotions, local=local)

    def _after_release(self, job: _Release, *, local: bool) -> None:
        """Run the release's deferred ack: here when on the loop thread, else on the loop (kombu's channel is
        not thread-safe)."""
        if job.after is None:
            return
        after, job.after = job.after, None
        if local:
            after()
        else:
            self._call_on_loop(after)

    def _call_on_loop(self, call: Callable[[], None]) -> None:
        """Any thread: run ``call`` on the consumer loop soon (woken through the pipe, or the polling timer);
        at once when no loop runs for us (the consumer is stopped: the caller is then Celery's own thread)."""
        if self._waker is None and not self._timers:
            call()
            return
        self._loop_calls.append(call)
        self._wake_loop()

    def _run_loop_calls(self) -> None:
        while self._loop_calls:
            call = self._loop_calls.popleft()
            try:
                call()
            except Exception:
                logger.exception("celery-keyed: deferred work on the consumer loop failed")

    def _flush_pending_releases(self) -> None:
        """Retry the releases that failed while the ledger was unreachable (heartbeat thread)."""
        while self._pending_releases:
            job = self._pending_releases[0]
            try:
                report = self.ledger.release(job.token, job.fence, job.outcome)
            except sa.exc.DBAPIError as exc:
                logger.info(
                    "celery-keyed: release of %s attempt %d still pending (%s)",
                    job.token.task_id,
                    job.token.attempt,
                    type(exc).__name__,
                )
                return
            self._pending_releases.popleft()
            logger.info(
                "celery-keyed: pending release of %s attempt %d done (%s); %d promoted",
                job.token.task_id,
                job.token.attempt,
                "released" if report.released else "already released",
                len(report.promotions),
            )
            self._after_release(job, local=False)
            self.dispatch(report.promotions, local=False)

    # -- revokes (consumer loop thread: Celery's revoke control command) --------------------------------

    def record_revokes(self, task_ids: Iterable[str]) -> None:
        """Celery's revoke broadcast reached this worker: store each revoke in the ledger (D11), so that a
        parked task, whose message lives in the ledger and in no worker's memory, leaves the waiting room with
        outcome ``revoked``. Every worker gets the broadcast: the first transaction to lock the task's row takes
        its parked rows, the others find none (idempotent). The ``KeyedRevoked`` result is stored here, before
        Celery's own handler runs; that handler leaves a finished result alone instead of storing a plain
        REVOKED. With the ledger unreachable the revokes are kept and stored when it is back (heartbeat).
        This is the one ledger call left on the consumer loop (a control command, not the task path): Celery's
        handler, right after it, stores REVOKED for a task it does not know, so ours must come first."""
        ids = [str(task_id) for task_id in task_ids]
        if not ids:
            return
        if self._breaker_open:
            self._pending_revokes.extend(ids)
            return
        try:
            self._store_revokes(ids, local=True)
        except sa.exc.OperationalError as exc:
            self._open_breaker(exc)
            self._pending_revokes.extend(ids)

    def _store_revokes(self, task_ids: list[str], *, local: bool) -> None:
        for task_id in task_ids:
            self.dispatch(self.ledger.revoke(task_id), local=local)  # a revoked group member: its group moves on
        self.notify_never_ran()

    def _flush_pending_revokes(self) -> None:
        """Store the revokes received while the ledger was unreachable (heartbeat thread)."""
        while self._pending_revokes:
            task_id = self._pending_revokes[0]
            try:
                self._store_revokes([task_id], local=False)
            except sa.exc.DBAPIError:
                return
            self._pending_revokes.popleft()

    # -- promotions ------------------------------------------------------------------------------------

    def dispatch(self, promotions: list[Promotion], *, local: bool) -> None:
        """Start promoted attempts: here from the stored message when allowed and this worker consumes their
        queue (D4), else republished with their nonce (D5). ``local``: we are on the consumer loop thread;
        off the loop, promotions to run here are queued for the loop (a timer drains them)."""
        for promotion in promotions:
            if self._closed:  # shutting down: this worker starts nothing new (its promotions carry nonces)
                self._republish_now(promotion)
                continue
            if promotion.nonce is not None and not self._pool_has_room():
                self._republish_now(promotion)  # a busy pool would keep it waiting: any worker may take it
                continue
            if not local and self.settings.local_handoff and self._consumes(promotion) and self._timers:
                self._to_loop.append(promotion)
                self._wake_loop()
                continue
            if local and self.settings.local_handoff and self._consumes(promotion):
                try:
                    self._run_here(promotion)
                    continue
                except Exception:
                    logger.exception("celery-keyed: local handoff of %s failed; republishing", promotion.task_id)
            self._republish_now(promotion)

    def _local_handoff(self) -> tuple[list[str] | None, list[str] | None]:
        """Queues (names and routing keys) and tasks this worker consumes, for promotions bound to it at once
        (D4, no bind round trip); None when local handoff is off."""
        task_consumer = getattr(self.consumer, "task_consumer", None)
        if not self.settings.local_handoff or task_consumer is None or self._closed or not self._pool_has_room():
            return None, None
        queues = getattr(task_consumer, "queues", ())
        return [q.name for q in queues] + [q.routing_key for q in queues], list(self.consumer.strategies)

    def _pool_has_room(self) -> bool:
        """Whether a pool process is free for one more request now: fewer requests received and not finished
        than pool processes. A promotion bound here while the pool is busy would hold its slot and keep its
        line waiting on this worker while others idle; it is published for any worker instead."""
        pool = getattr(self.consumer, "pool", None)
        size = getattr(pool, "num_processes", None) or getattr(pool, "limit", None)
        if not isinstance(size, int) or size <= 0:
            return True
        return len(worker_state.reserved_requests) < size

    def _attach_waker(self, hub: Any) -> None:
        """Let the threads wake the consumer loop the moment they hand it work (a pipe the hub reads): no
        polling timer between a promotion found off the loop and its start. Re-attached on every consumer
        start (the hub forgets its readers when the connection resets); the pipe lives as long as the service."""
        if self._waker is None:
            read_fd, write_fd = os.pipe()
            os.set_blocking(read_fd, False)
            os.set_blocking(write_fd, False)
            self._waker = (hub, read_fd, write_fd)
        else:
            self._waker = (hub, self._waker[1], self._waker[2])
        hub.add_reader(self._waker[1], self._on_wake)

    def _wake_loop(self) -> None:
        """Any thread: make the consumer loop run ``_drain_to_loop`` soon."""
        waker = self._waker
        if waker is None:
            return
        with contextlib.suppress(OSError):  # BlockingIOError: the pipe is full, so a wakeup is pending anyway
            os.write(waker[2], b"\0")

    def _on_wake(self, *args: Any) -> None:
        waker = self._waker
        if waker is not None:
            with contextlib.suppress(OSError):
                while os.read(waker[1], 4096):  # read before draining: a later write wakes us again
                    pass
        self._drain_to_loop()

    def _drain_to_loop(self) -> None:
        """Consumer loop (woken by a thread, or on a timer): start the promotions the threads found; follow the
        breaker with the keyed-only queues."""
        self._run_loop_calls()
        while self._to_loop:
            self.dispatch([self._to_loop.popleft()], local=True)
        self._sync_keyed_queues()

    def _consumes(self, promotion: Promotion) -> bool:
        record = promotion.message or {}
        task_consumer = getattr(self.consumer, "task_consumer", None)
        if task_consumer is None or record.get("task") not in self.consumer.strategies:
            return False
        names = {q.name for q in getattr(task_consumer, "queues", ())}
        routing_keys = {q.routing_key for q in getattr(task_consumer, "queues", ())}
        return record.get("routing_key") in names | routing_keys

    def _run_here(self, promotion: Promotion) -> None:
        record = promotion.message
        if promotion.nonce is None:  # already bound to this worker in the promotion's transaction
            with self._lock:
                self._prebound[promotion.token] = _Prebound(promotion.fence, promotion.key)
        message = restore_message(record, nonce=None if promotion.nonce is None else str(promotion.nonce))
        strategy = self._handoff_strategy(record["task"])
        try:
            strategy(message, None, _already_acked, _already_acked, set())
        except Exception:
            with self._lock:
                self._prebound.pop(promotion.token, None)
            raise
        self._announce_promoted(promotion, local=True)
        if promotion.token in self._prebound and promotion.task_id in worker_state.revoked:
            self._revoked_before_start(promotion.token, promotion.key)  # Celery's strategy discarded it

    def _handoff_strategy(self, task_name: str) -> Any:
        """The consumer's strategy for ``task_name``, built once more with an event dispatcher that leaves out
        ``task-received``: a promotion started here was received (and announced) when it first arrived; every
        later event of its request (started, succeeded…) is sent as usual. Rebuilt when Celery rebuilds its
        strategies (on every broker reconnect)."""
        strategy = self.consumer.strategies[task_name]
        dispatcher = getattr(self.consumer, "event_dispatcher", None)
        if dispatcher is None or not getattr(dispatcher, "enabled", False):
            return strategy
        cached = self._handoff_strategies.get(task_name)
        if cached is not None and cached[0] is strategy and cached[1] is dispatcher:
            return cached[2]
        task = self.app.tasks[task_name]
        handoff = default_strategy(task, self.app, _HandoffConsumer(self.consumer, _NoReceivedEvent(dispatcher)))
        self._handoff_strategies[task_name] = (strategy, dispatcher, handoff)
        return handoff

    def _revoked_before_start(self, token: Token, key: str | None) -> None:
        """A promotion bound to this worker (D4) whose request Celery discarded as revoked: give its slot back
        with outcome ``revoked``."""
        with self._lock:
            prebound = self._prebound.pop(token, None)
        if prebound is not None:
            self._hand_over(token, prebound.fence, Outcome.REVOKED, key=key, name="", contended=True)

    def _give_back_prebound(self, stale: Callable[[_Prebound], bool], why: str, *, on_loop: bool = True) -> None:
        """Promotions bound here (D4) whose request has not started go back in line (outcome "worker lost": the
        ledger restores them from their stored message and gives the slot to the next in line, which may be
        another worker). The request, if it reaches a pool process later, is then a duplicate (D14, D8)."""
        with self._lock:
            taken = [(token, p) for token, p in self._prebound.items() if stale(p)]
            for token, _ in taken:
                del self._prebound[token]
        for token, p in taken:
            logger.warning(
                "celery-keyed: promoted %s attempt %d goes back in line: %s", token.task_id, token.attempt, why
            )
            self._hand_over(token, p.fence, Outcome.WORKER_LOST, key=p.key, name="", contended=True, on_loop=on_loop)

    def _republish_now(self, promotion: Promotion) -> None:
        if promotion.nonce is None:
            # Bound to this worker but it cannot start it here: it goes back in line from its stored message.
            logger.warning("celery-keyed: could not start promoted %s here; it goes back in line", promotion.task_id)
            self._hand_over(
                promotion.token,
                promotion.fence,
                Outcome.WORKER_LOST,
                key=promotion.key,
                name="",
                contended=True,
                on_loop=False,
            )
            return
        try:
            republish(self.app, promotion.message, nonce=str(promotion.nonce))
            self._announce_promoted(promotion, local=False)
        except Exception:
            # The promotion stays in the ledger; the reaper re-parks it after the dispatch timeout (D5).
            logger.exception("celery-keyed: could not republish promoted %s", promotion.task_id)

    # -- heartbeat thread (D7) -------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        """D13: runs from the first consumer start until the worker has shut down and no claim it tracks is
        left (running attempts, promotions bound here, releases not yet committed)."""
        while not self._heartbeat_exit.wait(self.settings.heartbeat_interval):
            if self._closed and not (self._running or self._prebound or self._pending_releases):
                return
            try:
                self.heartbeat_once()
            except Exception:
                logger.exception("celery-keyed: heartbeat failed")

    def heartbeat_once(self) -> None:
        """Renew the leases of the attempts this process runs and of the promotions bound to it that wait for
        a pool process; notice lost slots; self-fence when the ledger has been unreachable for too long; give
        back promotions that waited too long; retry releases that failed; probe the breaker."""
        with self._lock:
            running = list(self._running.values())
            prebound = dict(self._prebound)
        held = {HeldClaim(r.token.task_id, r.token.attempt, r.fence): r for r in running}
        waiting = {HeldClaim(t.task_id, t.attempt, p.fence): (t, p) for t, p in prebound.items()}
        try:
            if held or waiting:
                renewed = self.ledger.renew([*held, *waiting])
            else:  # nothing to renew: still find out whether the ledger is reachable (the breaker's probe)
                renewed = set()
                with self.engine.connect() as conn:
                    conn.exec_driver_sql("SELECT 1")
        except sa.exc.OperationalError as exc:
            self._open_breaker(exc)
            deadline = self._last_renewal + self.settings.lease - self.settings.self_fence_margin
            if time.monotonic() > deadline:
                self._self_fence([r for r in running if not r.fenced], "the ledger has been unreachable for a lease")
            return
        self._last_renewal = time.monotonic()
        self._close_breaker()
        pids = self._process_ids()
        if pids != self._pids:  # a pool process was replaced: a successor must know every pid to check (item 8)
            with contextlib.suppress(sa.exc.SQLAlchemyError):
                self.ledger.record_pids(pids)
                self._pids = pids
        lost = [r for claim, r in held.items() if claim not in renewed and r.request.keyed_claim is not None]
        for r in lost:  # reclaimed: our release would be fenced anyway; stop tracking it
            with self._lock:
                self._running.pop(r.token, None)
            r.request.keyed_claim = None
        if lost:
            self._self_fence(lost, "its slot was reclaimed (lease expired)")
        with self._lock:
            for claim, (token, p) in waiting.items():
                if claim not in renewed and self._prebound.get(token) is p:
                    del self._prebound[token]  # lapsed: its request, if it starts, is admitted as usual (D14)
        # A promotion bound here that no pool process took within a heartbeat: its line must not wait on this
        # worker's busy pool while others idle.
        now = time.monotonic()
        self._give_back_prebound(
            lambda p: now - p.since >= self.settings.heartbeat_interval, "no pool process took it", on_loop=False
        )
        self._release_never_started(running)
        self._flush_pending_releases()
        self._flush_pending_revokes()

    def _release_never_started(self, running: list[_Running]) -> None:
        """D6: a request admitted but dropped before a pool process accepted it (the consumer reset on a broker
        reconnect forgets reserved requests; the broker redelivers their messages) would otherwise keep its
        claim renewed for ever. Such claims are released as "worker lost" once they are older than half a
        lease and their request is neither started nor reserved any more."""
        reserved = worker_state.reserved_requests
        for r in running:
            request = r.request
            if request.keyed_started or request in reserved or r.fenced:
                continue
            if time.monotonic() - r.claimed_at < self.settings.lease / 2:
                continue
            logger.warning(
                "celery-keyed: %s[%s] was admitted but never started; releasing its slot", request.name, r.token.task_id
            )
            claim = request.keyed_claim
            request.keyed_claim = None
            with self._lock:
                self._running.pop(r.token, None)
            if claim is None:
                continue
            self._hand_over(
                claim[0],
                claim[1],
                Outcome.WORKER_LOST,
                key=request.keyed_arrival_key,
                name=request.name,
                contended=True,
                on_loop=False,
            )

    def _self_fence(self, running: list[_Running], why: str) -> None:
        """D7: an attempt that may have lost its slot must not go on running. On the prefork pool it is
        terminated (``keyed_self_fence``, on by default); elsewhere the bound is best-effort, and we say so."""
        for r in running:
            r.fenced = True
            if self.settings.self_fence and self._can_terminate():
                logger.error("celery-keyed: terminating %s[%s]: %s", r.request.name, r.token.task_id, why)
                # Kill the pool child rather than revoke: the attempt ends as "worker lost", so with acks_late
                # its message is redelivered and it runs again once it holds a slot (a revoke would be final).
                pid = getattr(r.request, "worker_pid", None)
                if pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            else:
                logger.error(
                    "celery-keyed: %s[%s] keeps running although %s; the bound is best-effort until it ends",
                    r.request.name,
                    r.token.task_id,
                    why,
                )

    def _process_ids(self) -> list[int]:
        """This process and the pool processes that may run its keyed bodies (prefork), sorted."""
        pids = {os.getpid()}
        pool = getattr(self.consumer, "pool", None)
        with contextlib.suppress(Exception):
            pids.update(int(p) for p in (pool.info or {}).get("processes") or ())  # type: ignore[union-attr]
        return sorted(pids)

    def _can_terminate(self) -> bool:
        pool = getattr(self.consumer, "pool", None)
        return pool is not None and type(pool).__module__.startswith("celery.concurrency.prefork")

    # -- sweeper thread (D2) ---------------------------------------------------------------------------

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.settings.sweep_interval):
            if self._breaker_open:
                continue
            try:
                self.sweep_once()
            except sa.exc.OperationalError as exc:
                self._open_breaker(exc)
            except Exception:
                logger.exception("celery-keyed: sweep failed")

    def sweep_once(self) -> None:
        """Time-triggered work (D2); every quarter lease also the reaper (D7), but only once this process has
        reached the ledger for a full lease: a worker that was cut off cannot tell a dead peer from a peer
        that was cut off too."""
        report = self.ledger.sweep(
            group_arrival_timeout=self.settings.group_arrival_timeout, reserve_timeout=self.settings.reserve_timeout
        )
        self.dispatch(report.promotions, local=False)
        now = time.monotonic()
        if now - self._last_gone_check >= self.settings.lease / 4:
            # Workers of this machine known dead (every process gone): no need to wait for their leases.
            self._last_gone_check = now
            self.dispatch(self.ledger.reclaim_gone_predecessors().promotions, local=False)
        if now - self._reachable_since >= self.settings.lease and now - self._last_reclaim >= self.settings.lease / 4:
            self._last_reclaim = now
            reclaimed = reclaim_once(self.engine, lease=self.settings.lease, dispatch=self.settings.dispatch_timeout)
            for token in reclaimed.reclaimed:
                logger.warning(
                    "celery-keyed: reclaimed the slot of %s attempt %d (its lease expired)",
                    token.task_id,
                    token.attempt,
                )
            self.dispatch(reclaimed.promotions, local=False)
        self.notify_never_ran()

    def notify_never_ran(self) -> None:
        """Store a failure result for every task that got a final outcome without running (D11)."""
        with self.engine.connect() as conn:
            rows = books_unnotified(conn)
        done = []
        for row in rows:
            self._store_never_ran(row.task_id, row.outcome, row.detail, None, task_name=row.task_name)
            done.append(row.task_id)
        if done:
            self.ledger.transaction(lambda conn: books_mark_notified(conn, done))

    def _store_never_ran(
        self, task_id: str, outcome: str, detail: str, record: dict[str, Any] | None, task_name: str = ""
    ) -> None:
        exc = exceptions.BY_OUTCOME.get(outcome, exceptions.KeyedOutcome)(detail)
        context = context_from_record(record) if record else {"id": task_id, "task": task_name}
        try:
            task = self.app.tasks.get(context.get("task") or task_name)
            backend = task.backend if task is not None else self.app.backend
            from celery.app.task import Context

            backend.mark_as_failure(task_id, exc, request=Context(context), store_result=True)
        except Exception:
            logger.exception("celery-keyed: could not store the %s outcome of %s", outcome, task_id)
        self._announce_never_ran(task_id, outcome, detail, str(context.get("task") or task_name), None)

    # -- inspection (``celery keyed inspect``, through Celery's remote control) ----------------------------

    def snapshot(self) -> dict[str, Any]:
        """What this gate holds now, JSON-able: running attempts, promotions handed here waiting for a pool
        process, requests held while the ledger is unreachable, releases not committed yet, the breaker."""
        now = time.monotonic()
        with self._lock:
            running = [
                {
                    "task_id": r.token.task_id,
                    "attempt": r.token.attempt,
                    "fence": r.fence,
                    "task": getattr(r.request, "name", ""),
                    "key": getattr(r.request, "keyed_arrival_key", None),
                    "started": bool(getattr(r.request, "keyed_started", False)),
                    "held_for": round(now - r.claimed_at, 3),
                    "fenced": r.fenced,
                }
                for r in self._running.values()
            ]
            prebound = [
                {
                    "task_id": t.task_id,
                    "attempt": t.attempt,
                    "fence": p.fence,
                    "key": p.key,
                    "waiting_for": round(now - p.since, 3),
                }
                for t, p in self._prebound.items()
            ]
        return {
            "holder": self.ledger.holder,
            "ledger_reachable": not self._breaker_open,
            "shutting_down": self._closed,
            "running": running,
            "handed_over": prebound,
            "held": [{"task_id": r.id, "task": r.name} for r in list(self._held)],
            "pending_releases": [
                {"task_id": j.token.task_id, "attempt": j.token.attempt, "outcome": j.outcome.value}
                for j in list(self._pending_releases)
            ],
            "pending_revokes": list(self._pending_revokes),
            "last_renewal_ago": round(now - self._last_renewal, 3),
        }

    # -- events, signals and logs (what Celery's tools see) ----------------------------------------------

    def _emit(self, event_type: str, **fields: Any) -> None:
        """Send a Celery event, as the worker's own events are sent: from the consumer loop's thread (kombu's
        channel is not thread-safe), handed to it from other threads; nothing when events are off (``-E``)."""
        dispatcher = getattr(self.consumer, "event_dispatcher", None)
        if dispatcher is None or not getattr(dispatcher, "enabled", False):
            return
        if threading.get_ident() == self._loop_thread:
            try:
                dispatcher.send(event_type, **fields)
            except Exception:
                logger.debug("celery-keyed: could not send %s", event_type, exc_info=True)
        elif self._waker is not None or self._timers:
            self._loop_calls.append(lambda: self._emit(event_type, **fields))
            self._wake_loop()

    def _announce_parked(self, task_id: str, task_name: str, key: str | None) -> None:
        logger.debug("celery-keyed: %s[%s] parked in the line of %s", task_name, task_id, key)
        signals.keyed_parked.send(sender=self, task_id=task_id, task_name=task_name, key=key)
        self._emit("task-keyed-parked", uuid=task_id, name=task_name, key=key)

    def _announce_promoted(self, promotion: Promotion, *, local: bool) -> None:
        name = (promotion.message or {}).get("task") or ""
        logger.debug(
            "celery-keyed: %s[%s] promoted into a slot of %s (%s)",
            name,
            promotion.task_id,
            promotion.key,
            "started here" if local else "published",
        )
        signals.keyed_promoted.send(
            sender=self, task_id=promotion.task_id, task_name=name, key=promotion.key, local=local
        )
        self._emit("task-keyed-promoted", uuid=promotion.task_id, name=name, key=promotion.key, local=local)

    def _announce_never_ran(self, task_id: str, outcome: str, detail: str, task_name: str, key: str | None) -> None:
        """A final outcome without a run (rejected, expired, superseded, revoked, lost, dead-lettered): its signal,
        and the Celery event Flower and ``celery events`` understand (task-rejected / task-revoked / task-failed,
        with ``keyed_outcome``), so the task does not look received for ever."""
        signal = signals.BY_OUTCOME.get(outcome)
        if signal is not None:
            signal.send(sender=self, task_id=task_id, task_name=task_name, key=key, detail=detail)
        event = signals.EVENT_BY_OUTCOME.get(outcome)
        if event is None:
            return
        fields: dict[str, Any] = {"uuid": task_id, "keyed_outcome": outcome, "keyed_key": key, "detail": detail}
        if event == "task-rejected":
            fields["requeue"] = False
        elif event == "task-revoked":
            fields.update(terminated=False, signum=None, expired=outcome == "expired")
        else:
            exc = exceptions.BY_OUTCOME.get(outcome, exceptions.KeyedOutcome)(detail)
            fields.update(exception=repr(exc), traceback="")
        self._emit(event, **fields)

    # -- circuit breaker (D9) --------------------------------------------------------------------------

    def _open_breaker(self, exc: BaseException) -> None:
        if not self._breaker_open:
            logger.error("celery-keyed: the ledger is unreachable (%s); keyed tasks wait until it is back", exc)
        self._breaker_open = True
        self._reachable_since = float("inf")
        self._wake_loop()  # the loop stops consuming the keyed-only queues

    def _close_breaker(self) -> None:
        if self._breaker_open:
            logger.warning("celery-keyed: the ledger is reachable again; keyed intake resumes")
            self._reachable_since = time.monotonic()
            self._breaker_open = False
            self._wake_loop()  # the loop consumes the keyed-only queues again

    def _sync_keyed_queues(self) -> None:
        """Consumer loop: while the breaker is open, do not consume the queues that carry only keyed tasks
        (``keyed_queues``), so that their messages stay in the broker instead of piling up, unacked, in this
        worker (D9); consume them again once it closes. Without ``keyed_queues`` the worker holds at most its
        prefetch of keyed messages. Loop thread only: kombu's channel is not thread-safe."""
        task_consumer = getattr(self.consumer, "task_consumer", None)
        if not self.settings.queues or task_consumer is None:
            return
        if self._breaker_open:
            for name in self.settings.queues:
                if name not in self._cancelled_queues and task_consumer.consuming_from(name):
                    self.consumer.cancel_task_queue(name)
                    self._cancelled_queues.append(name)
                    logger.warning(
                        "celery-keyed: stopped consuming keyed-only queue %r while the ledger is unreachable", name
                    )
            return
        while self._cancelled_queues:
            name = self._cancelled_queues.pop()
            self.consumer.add_task_queue(name)
            logger.warning("celery-keyed: consuming keyed-only queue %r again", name)

    def _hold(self, request: Any) -> None:
        """Keep a keyed request in memory (unacked) while the ledger is down; it stays in the broker's hands."""
        metrics.admission("held")
        self._held.append(request)

    def _resubmit_held(self) -> None:
        """Consumer loop timer: probe the ledger when the breaker is open; give held requests back to the pool
        once it is closed."""
        if self._breaker_open:
            try:
                with self.engine.connect() as conn:
                    conn.exec_driver_sql("SELECT 1")
            except sa.exc.OperationalError:
                self._sync_keyed_queues()
                return
            self._close_breaker()
        while self._held and not self._breaker_open:
            request = self._held.popleft()
            self.consumer.on_task_request(request)
        self._drain_to_loop()  # also a backstop for a missed wakeup


class _NoReceivedEvent:
    """An event dispatcher that forwards every event but ``task-received`` (see ``_handoff_strategy``)."""

    def __init__(self, dispatcher: Any) -> None:
        self._dispatcher = dispatcher

    @property
    def enabled(self) -> bool:
        return bool(self._dispatcher.enabled)

    def send(self, type: str, *args: Any, **fields: Any) -> Any:
        if type == "task-received":
            return None
        return self._dispatcher.send(type, *args, **fields)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dispatcher, name)


class _HandoffConsumer:
    """The consumer as Celery's strategy sees it, with another event dispatcher."""

    def __init__(self, consumer: Any, event_dispatcher: Any) -> None:
        self._consumer = consumer
        self.event_dispatcher = event_dispatcher

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def _already_acked(*args: Any, **kwargs: Any) -> None:
    """ack/reject of a message restored from the ledger: it was acked when it was parked."""


def _header_keys(value: Any) -> str | list[str] | None:
    """The concurrency key header: one key, or a list of keys (a task with several). Malformed → InvalidKey."""
    if value is None:
        return None
    if isinstance(value, list):
        keys = [normalize_key(v) for v in value]
        if not keys or len(set(keys)) != len(keys):
            raise InvalidKey(f"header {HEADER_KEY} must list distinct keys, got {value!r}")
        return keys[0] if len(keys) == 1 else keys
    return normalize_key(value)
