"""The consumer gate of one worker process: the composition of the worker's services (celery_keyed/worker/),
owned by the ``KeyedGate`` consumer bootstep (bootstep.py). docs/worker.md draws the services and their threads.

``GateService`` keeps the lifecycle (start / stop / shutdown / close), the admission of a request when a pool
process is ready for it (``execute``, D3: decided on the loop or handed to the admission service), the running
table (the claims this process holds), the snapshot and the events; the rest is a service each:

- ``worker.intake``: whether a request is keyed, and its ``Arrival`` (receipt checks, headers, D16 ranges);
- ``worker.admission``: admission off the consumer loop, in batches;
- ``worker.releaser``: releases off the loop, in batches, and the releases kept while the ledger is down;
- ``worker.heartbeat``: lease renewal and self-fencing, a thread of the process (D7, D13);
- ``worker.sweeper``: the due-time sweep (D2), the reaper, gone predecessors, results of tasks that never ran;
- ``worker.handoff``: the dispatch of promotions (one policy, ``route``) and the loop-calls pipe;
- ``worker.breaker``: the circuit breaker (D9);
- ``worker.revokes``: Celery's revoke commands stored in the ledger (D11).

Threads and fields of the gate itself:

- ``running`` (token -> ``Running``): under ``lock``; written by the loop (admission on the loop, releases),
  the admission thread (a claim is tracked the moment it is taken) and the heartbeat (lost claims); read by the
  heartbeat and the snapshot. ``lock`` also guards ``handoff.prebound``.
- ``closed`` (shutdown began), ``stopping`` (the consumer is stopped), ``generation`` (consumer starts),
  ``timers``: written by the lifecycle (Celery's thread: the loop's, or a signal handler's), read by every thread.
- ``_loop_thread``: the consumer loop's thread id (events are sent from it only).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from signal import SIGTERM
from typing import Any

import sqlalchemy as sa
from celery.exceptions import TaskRevokedError
from celery.worker import state as worker_state
from celery.worker.strategy import default as default_strategy

from celery_keyed import exceptions, metrics, signals
from celery_keyed.access import ledger_on
from celery_keyed.engine import create_ledger_engine
from celery_keyed.headers import HEADER_FENCE, HEADER_KEY, HEADER_NONCE, HEADER_ON_NEWER, HEADER_SUPERSEDE
from celery_keyed.ledger import (
    Admission,
    Arrival,
    HeldClaim,
    InvalidKey,
    LedgerError,
    Outcome,
    Promotion,
    Token,
    Verdict,
    key_name,
    new_holder,
)
from celery_keyed.settings import KeyedSettings
from celery_keyed.task import set_cancel_probe
from celery_keyed.worker import intake
from celery_keyed.worker.admission import AdmissionService, Job
from celery_keyed.worker.breaker import UNREACHABLE, Breaker
from celery_keyed.worker.exits import ExitWatch, pool_processes
from celery_keyed.worker.handoff import Handoff, Prebound, join_line, pool_line, slot_holders_ahead
from celery_keyed.worker.heartbeat import Heartbeat
from celery_keyed.worker.releaser import Releaser
from celery_keyed.worker.revokes import Revokes
from celery_keyed.worker.sweeper import Sweeper

logger = logging.getLogger("celery_keyed")

#: Threads of a worker process that keep one ledger connection each for their lifetime (``Ledger.pinned``): the
#: admission, receipt and releaser threads. The engine's pool keeps that many connections more than
#: ``keyed_pool_size``.
PINNED_THREADS = 3

# Seconds a worker remembers a promotion it gave back to the broker (``GateService._decline_promotion``): delivered
# here again within them, it is kept.
DECLINE_MEMORY = 60.0

#: Most seconds a claim taken ahead waits for other arrivals to share its round trip (``AdmissionService.lingering``);
#: at most half the wait expected for a pool process.
AHEAD_LINGER = 0.005

_current: GateService | None = None


def current_gate() -> GateService | None:
    """The gate of this worker process, or None outside a worker with ``install(app)``."""
    return _current


def keyed_strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Callable[..., Any]:
    """Task strategy of keyed tasks: Celery's default strategy. The gate acts through the request class
    (``KeyedRequest``), when the pool is ready to start the request (D3); receipt itself is Celery's: revoked
    and expired messages are dropped by it, unkeyed calls pass through untouched. One exception: a request Celery
    hands on for a pool process goes through ``GateService.receive`` first, which parks it at once when its key
    has a line (``keyed_park_at_receipt``)."""
    return default_strategy(task, app, _ReceivingConsumer(consumer), **kwargs)


class _ReceivingConsumer:
    """The consumer as Celery's strategy sees it for keyed tasks: requests ready for a pool process pass through
    the gate's ``receive`` (park at receipt) before the consumer's own ``on_task_request``."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer

    def on_task_request(self, request: Any) -> Any:
        gate = _current
        if gate is None:
            return self._consumer.on_task_request(request)
        return gate.receive(request, self._consumer.on_task_request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


@dataclass
class Running:
    """A claim this process holds: its request, attempt token and fence."""

    request: Any
    token: Token
    fence: int
    fenced: bool = False  # self-fencing already acted on it
    cancelled: str | None = None  # newest wins: a newer arrival asked it to stop (its detail), passed on here
    claimed_at: float = field(default_factory=time.monotonic)
    # Monotonic time taken before the ledger call that last set its lease was sent (the claim, then each renewal
    # that succeeded): the database counts the lease from that transaction's clock, which began after it, so the
    # lease cannot lapse before ``lease_from + keyed_lease`` (the self-fence's deadline, worker/fence.py, D19).
    lease_from: float = field(default_factory=time.monotonic)


_Running = Running  # the name tests knew


def _receipt_keys(job: Job) -> list[str]:
    """The keys a job handed to the receipt service counts for (``GateService._at_receipt``)."""
    keys = job.extra.get("keys")
    if keys is None:
        key = job.extra.get("key")
        keys = [key] if isinstance(key, str) else []
    return [key for key in keys if isinstance(key, str)]


def _cancellable(request: Any) -> bool:
    """Whether a newer arrival can ask this attempt to stop (newest wins): its claim carries a supersede key only when
    it was sent with ``on_newer`` or with a supersede key. The heartbeat asks the ledger about those only."""
    headers = getattr(request, "_request_dict", None) or {}
    if headers.get(HEADER_ON_NEWER) is not None or headers.get(HEADER_SUPERSEDE) is not None:
        return True
    task = getattr(request, "task", None)
    return getattr(task, "on_newer", None) is not None or getattr(task, "supersede_key", None) is not None


class GateService:
    """The gate of one worker process."""

    def __init__(self, app: Any, consumer: Any, settings: KeyedSettings) -> None:
        self.app = app
        self.consumer = consumer
        self.settings = settings
        self.engine = create_ledger_engine(settings, pinned=PINNED_THREADS)
        self.ledger = ledger_on(self.engine, settings, holder=new_holder(getattr(consumer, "hostname", None)))
        self.lock = threading.Lock()
        self.pid = os.getpid()  # the worker's main process (pool processes forked later inherit a copy of the gate)
        self.running: dict[Token, Running] = {}
        self.releasing = 0  # releases between leaving ``running`` and the releaser's hands (under ``lock``)
        self.closed = False  # shutdown began: no local handoff; the heartbeat ends with the last tracked claim
        self.stopping = threading.Event()  # the consumer is stopped (a decision handed back now is stale)
        self.generation = 0  # consumer starts: a decision handed back after a restart is stale
        self.started_at = 0.0  # monotonic time of the last consumer start
        self.timers: list[Any] = []  # the consumer loop's timers of this consumer start
        self._loop_thread: int | None = None  # the consumer loop's thread (events are sent from it only)
        self.breaker = Breaker(self)
        self.handoff = Handoff(self, self.lock)
        self.releaser = Releaser(self)
        self.exits = ExitWatch(lambda: pool_processes(self.consumer))  # releases held until a body stopped (D17)
        self.heartbeat = Heartbeat(self)
        self.releaser.on_released = self.heartbeat.failover.journal_released  # D20
        self.sweeper = Sweeper(self)
        self.revokes = Revokes(self)
        # Admission off the loop (worker/admission.py): on when the pool semaphore keeps a pool process for a
        # request while its admission is decided (prefork on the event loop); else admission runs on the loop.
        self.admission: AdmissionService | None = None
        # Park at receipt (``receive``): a thread of its own, so that a burst of parks never queues in front of the
        # admissions of requests a pool process is kept for.
        self.receipts: AdmissionService | None = None
        self._pool_release: Callable[[], None] | None = None
        self._returned = 0  # requests sent back to the pool semaphore's front in the current delivery (loop only)
        #: Loop only: while a decided batch is acted on, the pool processes it gives back (``_free_pool_slot``);
        #: None otherwise.
        self._frees: list[Callable[[], None]] | None = None
        self._warm_requested = False  # loop only: ``_warm_services`` asked once
        #: Loop only: key -> requests of it handed to the receipt service whose verdict the loop has not acted on.
        self._at_receipt: dict[str, int] = {}
        # nonces of published promotions this worker gave back to the broker once (``_decline_promotion``), with
        # when: a promotion is declined at most once per worker (loop only)
        self._declined: dict[str, float] = {}
        # The prefetch window's widening for claims taken ahead (``fit_prefetch``), and the QoS it was applied to
        # (a consumer restart brings a new one, at Celery's own width). Under ``lock``.
        self._spare = 0
        self._spare_qos: Any = None

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        global _current
        _current = self
        set_cancel_probe(self.cancelled)  # KeyedTask.keyed_cancelled (newest wins)
        self._loop_thread = threading.get_ident()  # Celery starts the consumer's steps on its loop thread
        metrics.serve(self.settings)  # keyed_metrics_port: once per process
        gone = None
        try:
            self.heartbeat.pids = self.heartbeat.process_ids()
            self.ledger.register_holder(pids=self.heartbeat.pids)
            self._warn_prefix_capture()
            self.ledger.configure(self.settings.limits, version=self.settings.config_version)
            gone = self.ledger.reclaim_gone_predecessors()
        except sa.exc.OperationalError as exc:
            self.breaker.open(exc)
        if gone is not None and gone.reclaimed:
            logger.warning(
                "celery-keyed: gave back %d claims of earlier worker starts on this machine whose processes are gone",
                len(gone.reclaimed),
            )
            self.dispatch(gone.promotions, local=False)
        self.stopping.clear()
        self.closed = False
        self.started_at = time.monotonic()  # the heartbeat's never-started check waits a beat after a (re)start
        # D13: the heartbeat belongs to the process, not to the consumer: it goes on through consumer restarts
        # (broker reconnects) and warm shutdown, as long as a body it tracks may run.
        self.heartbeat.start()
        self.sweeper.start()
        self.releaser.start()
        self.generation += 1
        timer = getattr(self.consumer, "timer", None)
        hub = getattr(self.consumer, "hub", None)
        if hub is not None:
            self.handoff.attach(hub)
        self._pool_release = self._pool_semaphore_release()
        if hub is not None and self._pool_release is not None and self.settings.admission_batch > 0:
            if self.admission is None:
                self.admission = AdmissionService(
                    self._decide, self._deliver, batch=self.settings.admission_batch,
                    thread_context=self._service_thread, warm=self.ledger.warm_up,
                )
            self.admission.start()
            if self.settings.park_at_receipt:
                if self.receipts is None:
                    self.receipts = AdmissionService(
                        self._decide, self._deliver, batch=self.settings.admission_batch, name="keyed-receipt",
                        thread_context=self._service_thread, warm=self.ledger.warm_up,
                    )
                self.receipts.start()
        if timer is not None:
            self.timers.append(timer.call_repeatedly(self.settings.probe_interval, self.breaker.probe_once))
            if hub is None:  # a polling transport (no event loop to wake): drain on a short timer
                self.timers.append(timer.call_repeatedly(0.01, self.handoff.drain))

    def stop(self) -> None:
        """Stop what belongs to the consumer: the sweeper, the releaser, the admission service, the loop's timers
        and wakeup. Celery calls it on every broker reconnect and at warm shutdown while the pool still runs
        tasks, so the heartbeat (renewal and self-fencing) goes on (D13), and running attempts keep their claims
        (their outcome hooks release them). Safe to call twice (it runs from signal handlers). The releaser
        finishes the releases handed to it; later ones run in the caller's thread."""
        self.stopping.set()
        self.sweeper.stop(join=False)
        if self.admission is not None:
            self.admission.stop()  # decides what was handed over; the loop's part (below) gives it back
        if self.receipts is not None:
            self.receipts.stop()
        self.releaser.stop(join=False)
        for entry in self.timers:
            with contextlib.suppress(Exception):
                entry.cancel()
        self.timers.clear()
        self.handoff.detach()
        self.sweeper.join()
        self.releaser.join()
        self.handoff.run_loop_calls()  # acks the releaser deferred until its commits (stop runs on the loop thread)

    def shutdown(self) -> None:
        """Worker shutdown (warm: the pool may still run keyed tasks). Promotions bound here that have not
        started go back in line for other workers, later promotions are published instead of run here (this
        worker takes no new work), and the heartbeat goes on renewing the running attempts until the last one
        has ended (D13). Safe to call twice."""
        global _current
        self.closed = True
        self.stop()
        self.handoff.give_back_prebound(lambda p: True, "the worker is shutting down")
        self.releaser.flush_pending()
        if _current is self:
            _current = None
            set_cancel_probe(None)
        self.handoff.close()  # the threads are stopped: nobody writes to the pipe any more

    def close(self, wait: float = 0.0) -> None:
        """Shut down and end the heartbeat now, whatever it still tracks (tests; a process that owns no
        running body any more). ``wait``: seconds to wait first for the running attempts to end and their
        releases to commit (``idle``), so that no release checks out a connection of the engine after it was
        disposed (one nobody would close)."""
        self.shutdown()
        deadline = time.monotonic() + wait
        while not self.idle() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.heartbeat.stop()
        self.engine.dispose()

    def widen_prefetch(self) -> Callable[[], None]:
        """Loop thread: open the consumer's prefetch window by one while a finished task's ack waits for its release
        to commit (D15), and return the call that closes it again (once; any thread). Without it the unacked message
        of a finished task holds its place in the window and the broker sends the free pool process nothing until
        the release has committed. kombu's QoS applies the change on the loop's next turn; an unlimited window
        (prefetch 0) stays unlimited."""
        qos = getattr(self.consumer, "qos", None)
        if qos is None:
            return lambda: None
        qos.increment_eventually()
        closed = threading.Event()

        def narrow() -> None:
            if not closed.is_set():
                closed.set()
                qos.decrement_eventually()

        return narrow

    def fit_prefetch(self) -> None:
        """Any thread: widen the consumer's prefetch window beyond Celery's own by as many messages as this worker's
        pool processes are expected to start within ``keyed_claim_ahead`` (``Handoff.prefetch_spare``: at most one
        per process), or narrow it back. With ``worker_prefetch_multiplier = 1`` a worker whose processes are all busy
        holds no message beyond them, so a request that will start on the next process to free is fetched only once
        that process is free, and its claim's round trip comes after the fetch (peers W3-W5: 6-10 ms between one
        task's end and the next start on a process, against 3 ms for the cookbook lock). A message fetched ahead waits
        here for at most about that bound (a few tens of milliseconds) where another worker might have taken it.
        No widening before a run was seen here, with ``keyed_claim_ahead`` off, without a receipt service (admission
        on the loop), while the ledger is unreachable or the consumer stops, or while Celery restores a window it
        narrowed after a reconnect; an unlimited window stays unlimited. Called as each run ends."""
        qos = getattr(self.consumer, "qos", None)
        limit = self.settings.claim_ahead
        wanted = 0
        if (
            limit
            and self.receipts is not None
            and self.receipts.accepting
            and not self.breaker.is_open
            and not self.closed
            and not self.stopping.is_set()
            # Celery restores a window it narrowed after a broker reconnect by setting it outright: no widening
            # until it is back at its own width.
            and getattr(self.consumer, "_maximum_prefetch_restored", True) is not False
        ):
            wanted = self.handoff.prefetch_spare(limit)
        with self.lock:
            if qos is not self._spare_qos:  # a new consumer start: Celery's window, not widened yet
                self._spare_qos, self._spare = qos, 0
            delta, self._spare = wanted - self._spare, wanted
        if qos is None or not delta:
            return
        if delta > 0:
            qos.increment_eventually(delta)
        else:
            qos.decrement_eventually(-delta)

    def release_unstarted(self, why: str) -> int:
        """The worker has stopped its pool (Celery's ``worker_shutdown``, sent after the warm shutdown's pool join): a
        request still in the running table that no pool process ever accepted will never start here. Its message went
        back to the broker unacked; its claim goes back now, as "worker lost" (its redelivery is admitted again, D8),
        instead of being held by a worker that is gone until its lease lapses (found under load: a claim taken ahead
        whose request was handed to the pool just before the warm shutdown, the job dropped unstarted). Returns how
        many; in the caller's thread (the releaser is stopped). First the releases held for a pool process's exit
        (a hard time limit) whose process is gone now, without waiting for the exit watch's next look."""
        self.exits.watch_once()
        with self.lock:
            unstarted = [r for r in self.running.values() if not getattr(r.request, "keyed_started", False)]
            for r in unstarted:
                self.running.pop(r.token, None)
        for r in unstarted:
            request = r.request
            claim, request.keyed_claim = request.keyed_claim, None
            if claim is None:
                continue
            logger.warning(
                "celery-keyed: %s[%s] never started: %s; releasing its slot", request.name, r.token.task_id, why
            )
            self.releaser.hand_over(
                claim[0], claim[1], Outcome.WORKER_LOST, key=request.keyed_arrival_key, name=request.name,
                contended=True, on_loop=False,
            )  # fmt: skip
        self.releaser.flush_pending()
        return len(unstarted)

    def idle(self) -> bool:
        """No attempt runs here and no release is on its way to the ledger."""
        with self.lock:
            if self.running or self.releasing:
                return False
        return self.releaser.idle()

    def _warn_prefix_capture(self) -> None:
        """§3.11: configuring a name turns every ``name:*`` key from a mutex into a gate. Runs before the
        configuration is stored, and says so for each name the ledger has seen keys of while they were K = 1
        identities (unconfigured, or configured as 1) and that is now configured with another limit."""
        names = sorted(n for n, c in self.settings.limits.items() if c.limit != 1)
        if not names:
            return
        for row in self.ledger.captured_keys(names):
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

    # -- the services' doors (bootstep, request, tests) ------------------------------------------------

    def is_keyed(self, request: Any) -> bool:
        return intake.is_keyed(request)

    def arrival_for(self, request: Any) -> Arrival | None:
        return intake.arrival_for(request)

    def dispatch(self, promotions: list[Promotion], *, local: bool) -> None:
        """Start promoted attempts where the handoff's policy says (``worker.handoff.route``). ``local``: the
        caller is the consumer loop's thread."""
        self.handoff.dispatch(promotions, local=local)

    def record_revokes(self, task_ids: Iterable[str]) -> None:
        """Celery's revoke broadcast reached this worker: store each revoke in the ledger (D11)."""
        self.revokes.record(task_ids)

    def heartbeat_once(self) -> None:
        self.heartbeat.heartbeat_once()

    def sweep_once(self) -> None:
        self.sweeper.sweep_once()

    def notify_never_ran(self) -> None:
        self.sweeper.notify_never_ran()

    # -- park at receipt (consumer loop thread; decided by the receipt service's thread) ----------------------

    def receive(self, request: Any, handle: Callable[[Any], Any]) -> Any:
        """Loop thread: Celery hands ``request`` on for a pool process (``handle``: the consumer's
        ``on_task_request``). An arrival whose key has a line here (it parked or promoted attempts recently) would
        only park once a pool process is ready for it, holding that process — which a promotion handed to this
        worker, or an attempt that will run, needs — for a round trip. So it goes to the receipt service now (an
        admission service on a thread of its own, ``keyed-receipt``, so that a burst of parks never queues in front
        of the admissions of requests a pool process is kept for), which parks it without a pool process
        (``Ledger.park_at_receipt``; ``keyed_park_at_receipt``). Where its key turns out to have room and no line,
        nothing is written and it goes on to ``handle`` as usual: a slot is claimed when a pool process can start
        the attempt (D3), or ahead of it when the request will wait for one, not long (``_ahead_job``).

        Only plain arrivals (one key, no group, no not-before, cost 1), and never ahead of an earlier request of
        the same key still waiting here for a pool process (the line's order is the order the ledger receives
        them, D10)."""
        try:
            self._warm_services()
            if self._decline_promotion(request):
                return None
            job = self._receipt_job(request, handle)
            if job is None:
                job = self._ahead_job(request, handle)
            if job is None:
                job = self._pass_job(request, handle)
        except Exception:  # a fault of this shortcut must never reach the consumer loop (it would kill the worker)
            if getattr(request, "acknowledged", False) is True:  # given back to the broker: not here too
                with contextlib.suppress(Exception):
                    worker_state.task_ready(request)
                return None
            logger.exception("celery-keyed: the receipt check of %s failed; it waits for a pool process", request)
            job = None
        if job is None:
            return handle(request)
        if not self._submit_receipt(job):
            request.keyed_receipt = False
            return handle(request)
        return None

    def _submit_receipt(self, job: Job) -> bool:
        """Loop thread: hand ``job`` to the receipt service; its key counts as having a request there (``_at_receipt``)
        until the loop has acted on its verdict (``_received``). False: the service takes no new work."""
        service = self.receipts
        if service is None or not service.submit(job):
            return False
        for key in _receipt_keys(job):
            self._at_receipt[key] = self._at_receipt.get(key, 0) + 1
        return True

    def _ahead_job(self, request: Any, handle: Callable[[Any], Any]) -> Job | None:
        """Loop thread: the receipt service's job that claims ``request``'s slot ahead (``keyed_claim_ahead``), or
        None. D3 claims a slot when a pool process is ready for the request, so that a prefetched message never holds
        a slot while another worker could run its key; but the claim's round trip then sits between a free pool
        process and the start, and claims come one or two at a time. A request that will wait for a process here
        anyway, and not long (``Handoff.start_expected``: more than nothing, at most ``keyed_claim_ahead`` seconds:
        50 ms by default), has its slot claimed while it waits, with the other arrivals received meanwhile in one
        ``admit_many`` (an arrival that finds no room or a line is parked at once, as its admission would park it).
        The claim waits in ``Handoff.prebound`` (renewed by the heartbeat, given back if no process took it within a
        heartbeat interval or at shutdown) among the requests in the line for a process that hold a slot, oldest
        first (``join_line``), and the request starts with no round trip while the claim's lease provably holds
        (``Handoff.take_fresh_entry``), else after a guarded confirmation (D14). The prefetch window is widened so
        that such requests are here before a process frees (``fit_prefetch``).

        Only plain arrivals (one key, no group, no not-before, cost 1, no supersede key) of a key with no line here,
        no attempt holding its mutex here, no earlier request waiting here undecided and none at the receipt service
        (the ledger receives a key's arrivals in the order this worker received them, D10)."""
        service = self.receipts
        limit = self.settings.claim_ahead
        if (
            not limit
            or service is None
            or not service.accepting
            or self.breaker.is_open
            or self.closed
            or self.stopping.is_set()
            or not hasattr(request, "keyed_claim")
        ):
            return None
        headers = request._request_dict
        key = headers.get(HEADER_KEY)
        if not isinstance(key, str) or headers.get(HEADER_NONCE) is not None or self._at_receipt.get(key):
            return None
        if self.releaser.is_contended(key) or self._mutex_held_here(key):
            return None
        wait = self.handoff.start_expected(request)
        if wait is None or wait <= 0.0 or wait > limit:
            return None
        try:
            arrival = intake.arrival_for(request)
        except Exception:  # D16: admission at pool-ready records the rejection
            return None
        if arrival is None or arrival.key != key or not self.ledger.parks_at_receipt(arrival):
            return None
        if self._line_here(request, key):
            return None
        request.keyed_arrival_key = key
        request.keyed_arrival = arrival  # its admission's arrival too (``execute``): computed once
        request.keyed_receipt = True
        # It waits for a process anyway: its claim may wait for other arrivals to share the round trip, a part of
        # that wait (``AdmissionService.lingering``).
        by = time.monotonic() + min(wait / 2, AHEAD_LINGER)
        return Job(
            request,
            arrival,
            lambda: handle(request),
            extra={"generation": self.generation, "receipt": True, "ahead": True, "key": key, "by": by},
        )

    def _pass_job(self, request: Any, handle: Callable[[Any], Any]) -> Job | None:
        """Loop thread: a request that neither parks nor is claimed at receipt while an earlier request of its key is
        at the receipt service goes there too, to be handed on (``handle``) after it, in order, with no ledger call:
        otherwise a free pool process could take it to the ledger first (D10). None when its key has nothing
        there."""
        headers = getattr(request, "_request_dict", None) or {}
        key = headers.get(HEADER_KEY)
        # A task of several keys carries a list; a hostile header any JSON value: only strings are keys.
        keys = [one for one in (key if isinstance(key, list) else [key]) if isinstance(one, str)]
        if not any(self._at_receipt.get(one) for one in keys):
            return None
        return Job(
            request,
            None,
            lambda: handle(request),
            extra={"generation": self.generation, "receipt": True, "pass": True, "keys": keys},
        )

    def _decline_promotion(self, request: Any) -> bool:
        """Loop thread: give a published promotion (it carries a nonce, D5) back to the broker when this worker's
        pool cannot start it soon (``Handoff.pool_has_room`` without it: every process has work that will run, and
        not short work). It holds its slot while it waits, so waiting here behind long work keeps its key's line
        stopped while another worker may idle — a worker with a free prefetch slot fetches it as readily as an idle
        one. Requeued, it goes to a worker waiting on the queue. Each worker declines a promotion once only (its
        nonce is remembered for ``DECLINE_MEMORY`` seconds): a second delivery here is kept, so a promotion never
        bounces for ever when every pool is busy. Its claim stays promoted meanwhile, voided past its dispatch
        deadline as always (D5). Returns whether it was declined."""
        headers = getattr(request, "_request_dict", None) or {}
        nonce = headers.get(HEADER_NONCE)
        if not isinstance(nonce, str) or self.closed or self.stopping.is_set():
            return False
        if getattr(request, "acknowledged", True) or self.handoff.pool_has_room(exclude=request):
            return False
        now = time.monotonic()
        if len(self._declined) > 1024:
            self._declined = {n: at for n, at in self._declined.items() if now - at < DECLINE_MEMORY}
        at = self._declined.get(nonce)
        if at is not None and now - at < DECLINE_MEMORY:
            return False
        self._declined[nonce] = now
        request.reject(requeue=True)
        with contextlib.suppress(Exception):  # requeued: it must never also run here
            worker_state.task_ready(request)
            logger.info(
                "celery-keyed: promoted %s given back to the broker: every pool process here has long work",
                request.id,
            )
        return True

    def _receipt_job(self, request: Any, handle: Callable[[Any], Any]) -> Job | None:
        """Loop thread: the receipt service's job for ``request`` when it parks at receipt (``receive``), else None."""
        admission_service = self.receipts
        if (
            not self.settings.park_at_receipt
            or admission_service is None
            or not admission_service.accepting
            or self.breaker.is_open
            or self.closed
            or self.stopping.is_set()
            or not hasattr(request, "keyed_claim")
        ):
            return None
        key = request._request_dict.get(HEADER_KEY)
        if not isinstance(key, str) or not (self.releaser.is_contended(key) or self._mutex_held_here(key)):
            return None
        if request._request_dict.get(HEADER_NONCE) is not None:
            return None  # a promotion published to a worker: already bound in the ledger, it never parks
        try:
            arrival = intake.arrival_for(request)
        except Exception:  # D16: admission at pool-ready records the rejection
            return None
        if arrival is None or arrival.key != key or not self.ledger.parks_at_receipt(arrival):
            return None
        if self._line_here(request, key):
            return None
        request.keyed_arrival_key = key
        request.keyed_receipt = True
        extra = {"generation": self.generation, "receipt": True, "key": key}
        return Job(request, arrival, lambda: handle(request), extra=extra)

    def _mutex_held_here(self, key: str) -> bool:
        """Whether an attempt of ``key`` holds its claim in this worker while its name is a mutex as configured
        (``keyed_concurrency_limits``: limit 1, the default): an arrival of that key has no room, so it is parked at
        receipt even before the key parked or promoted anything here — in a burst, the requests received while
        every key runs would otherwise each wait for a pool process just to be parked. A runtime override that
        raised the limit only costs that round trip: the receipt leaves an arrival with room to its admission."""
        return key in self.held_mutex_keys()

    def held_mutex_keys(self) -> set[str]:
        """Any thread: the keys whose attempt holds its claim in this worker while their name is a mutex as configured
        (``keyed_concurrency_limits``: limit 1, the default) — an arrival of one of them has no room now."""
        with self.lock:
            running = list(self.running.values())
            bound = [p.key for p in self.handoff.prebound.values()]
        held: set[str] = set()
        for one in bound:  # a claim bound here waits for its request (a promotion, or a claim taken ahead)
            if isinstance(one, str) and one not in held:
                config = self.settings.limits.get(key_name(one))
                if config is None or config.limit == 1:
                    held.add(one)
        for entry in running:
            key = (getattr(entry.request, "_request_dict", None) or {}).get(HEADER_KEY)
            if isinstance(key, str) and key not in held:
                config = self.settings.limits.get(key_name(key))
                if config is None or config.limit == 1:
                    held.add(key)
        return held

    def _line_here(self, request: Any, key: str) -> bool:
        """Whether a request of ``key`` received before ``request`` waits here for a pool process (its admission
        not decided yet)."""
        return bool(self._undecided_keys({key}, skip=lambda other: other is request))

    def _undecided_keys(self, keys: set[str], *, skip: Callable[[Any], bool]) -> set[str]:
        """The keys among ``keys`` with a request received here whose place in its key's line is not decided yet:
        reserved, not running, no claim, not in the receipt service, and not a promotion (bound here, or carrying
        a nonce: it left its line in the ledger already, D4 / D5, so a later arrival may park before it starts).
        ``skip``: requests not to count."""
        active = worker_state.active_requests
        with self.lock:
            bound_here = {token.task_id for token in self.handoff.prebound}
        undecided: set[str] = set()
        for other in list(worker_state.reserved_requests):
            if skip(other) or other in active or getattr(other, "keyed_receipt", False):
                continue
            if getattr(other, "keyed_claim", None) is not None or getattr(other, "id", None) in bound_here:
                continue
            headers = getattr(other, "_request_dict", None) or {}
            if headers.get(HEADER_NONCE) is not None:
                continue
            other_key = getattr(other, "keyed_arrival_key", None) or headers.get(HEADER_KEY)
            # A task of several keys carries a list; a hostile header any JSON value: only strings are keys.
            for one in other_key if isinstance(other_key, list) else (other_key,):
                if isinstance(one, str) and one in keys:
                    undecided.add(one)
        return undecided

    def park_waiting(self) -> int:
        """Loop thread: ``_park_waiting``, whose faults never reach the consumer loop (they would kill the worker):
        a request it did not take keeps its place and waits for a pool process as in plain Celery."""
        try:
            return self._park_waiting()
        except Exception:
            logger.exception("celery-keyed: parking the requests waiting for a pool process failed")
            return 0

    def _park_waiting(self) -> int:
        """Loop thread: requests that wait in Celery's pool semaphore for a process, received before their key was
        busy here, are taken out of that line and handed to the receipt service once their key has a line here or
        its mutex runs here — as an arrival received now would be (``receive``). Without it each waits for a pool
        process only to be parked, holding the process a promotion bound here needs for a round trip, and a burst's
        promotions wait behind them (bench.gate d). In their order of receipt; a key is left alone while one of its
        requests is in admission flight (it holds a process and its decision is not back: D10), and from the first
        of its requests that cannot park at receipt. A request taken out and sent back undecided (room after all)
        returns to the front of the line, in order, and is never taken out again. Returns how many it took."""
        admission_service = self.receipts
        if (
            not self.settings.park_at_receipt
            or admission_service is None
            or not admission_service.accepting
            or self.breaker.is_open
            or self.closed
            or self.stopping.is_set()
        ):
            return 0
        waiting = pool_line(self.consumer)
        if not waiting:
            return 0
        held = self.held_mutex_keys()
        with self.lock:  # promotions bound here (D4) wait in the same line: they start, they never park
            bound_here = {token.task_id for token in self.handoff.prebound}
        candidates: list[tuple[Any, Any, str]] = []
        queued: set[int] = set()
        for entry in list(waiting):
            if not (isinstance(entry, tuple) and len(entry) == 3 and entry[1]):
                continue
            request = entry[1][0]
            queued.add(id(request))
            if not hasattr(request, "keyed_claim") or request.keyed_claim is not None:
                continue
            if getattr(request, "keyed_receipt", False) or getattr(request, "keyed_pulled", False):
                continue
            if getattr(request, "id", None) in bound_here:
                continue
            headers = getattr(request, "_request_dict", None) or {}
            key = headers.get(HEADER_KEY)
            if not isinstance(key, str) or headers.get(HEADER_NONCE) is not None:
                continue
            if key in held or self.releaser.is_contended(key):
                candidates.append((entry, request, key))
        if not candidates:
            return 0
        keys = {key for _, _, key in candidates}
        # A key with a request whose admission is under way (it holds a process, its decision not back) stays: its
        # later requests must not reach the ledger before it (D10).
        blocked = self._undecided_keys(keys, skip=lambda other: id(other) in queued)
        taken = 0
        for entry, request, key in candidates:
            if key in blocked:
                continue
            try:
                arrival = intake.arrival_for(request)
            except Exception:  # D16: its admission at pool-ready records the rejection
                arrival = None
            if arrival is None or arrival.key != key or not self.ledger.parks_at_receipt(arrival):
                blocked.add(key)  # the later ones of its key stay behind it
                continue
            try:
                waiting.remove(entry)
            except ValueError:  # gone meanwhile (it cannot be: the loop's own)
                continue
            request.keyed_arrival_key = key
            request.keyed_receipt = True
            request.keyed_pulled = True
            job = Job(
                request,
                arrival,
                functools.partial(self._back_in_line, request),
                extra={"generation": self.generation, "receipt": True, "key": key},
            )
            if not self._submit_receipt(job):
                request.keyed_receipt = False
                waiting.insert(slot_holders_ahead(waiting), entry)
                return taken
            taken += 1
        return taken

    def _back_in_line(self, request: Any) -> None:
        """Loop thread: a request taken out of the pool semaphore's line (``park_waiting``) that was not parked goes
        back to the front of the requests there that hold no slot, behind the others sent back in the same delivery
        (their order kept; ``join_line``)."""
        waiting = pool_line(self.consumer)
        before = len(waiting) if waiting is not None else 0
        self.consumer.on_task_request(request)
        if waiting is None or len(waiting) <= before:
            return  # it got a pool process at once
        join_line(self.consumer, request, behind=self._returned)
        self._returned += 1

    def _received(self, job: Job) -> None:
        """Loop thread: act on the park-at-receipt decision of ``job``: parked (acked, announced) or rejected
        (recorded, its result stored), or on to Celery's ``on_task_request`` (``job.submit``) for its admission
        when a pool process is ready. A claim taken ahead (``_ahead_job``) waits in ``Handoff.prebound`` for the
        request, which goes on to Celery's ``on_task_request``; a request handed on in order (``_pass_job``) goes on
        too."""
        request = job.request
        request.keyed_receipt = False
        for key in _receipt_keys(job):
            if self._at_receipt.get(key, 0) > 1:
                self._at_receipt[key] -= 1
            else:
                self._at_receipt.pop(key, None)
        if self.stopping.is_set() or self.closed or job.extra.get("generation") != self.generation:
            # The consumer stopped since the hand-over: Celery has forgotten its requests, and the broker
            # redelivers the message (a parked one is then recognised as a duplicate, D8). A claim taken ahead goes
            # back (the redelivered copy is admitted again, D8: finished as worker lost).
            if job.extra.get("ahead") and job.arrival is not None:
                self._give_back_ahead(job.arrival.token)
            worker_state.task_ready(request)
            return
        if job.extra.get("pass"):
            job.submit()
            return
        if job.error is not None:
            if isinstance(job.error, UNREACHABLE):
                self.breaker.open(job.error)
            job.submit()  # admission at pool-ready holds it (D9) or records the refusal (D16)
            return
        _, admission = job.result
        if admission is None:
            job.submit()
            return
        if job.extra.get("ahead"):
            if admission.cancels:  # newest wins (not for plain arrivals; kept for safety)
                self.pass_on_cancels(admission.cancels, f"superseded by {request.id} (newest wins)")
            if admission.promotions:  # waiters ahead of it started with the room it found
                self.dispatch(list(admission.promotions), local=True)
            if admission.verdict is Verdict.ADMITTED:
                # Its claim waits in Handoff.prebound (``_claim_ahead``) until a pool process starts it; it holds a
                # slot, so it waits among the requests that do (``join_line``).
                request.keyed_slot_held = True
                job.submit()
                join_line(self.consumer, request)
                return
            metrics.started(job.arrival.token, admission.verdict)
            self._not_admitted(request, admission)
            return
        metrics.started(job.arrival.token, admission.verdict)
        if admission.verdict is Verdict.PARKED:
            self._not_admitted(request, admission)
        else:
            self._finish_without_running(request, admission.verdict.value, admission.detail)

    def _give_back_ahead(self, token: Token) -> None:
        """Any thread: give back the claim taken ahead for ``token`` that no pool process will start here (outcome
        "worker lost": a redelivered copy is admitted again, D8)."""
        with self.lock:
            entry = self.handoff.prebound.get(token)
            if entry is None or not entry.ahead:
                return
            del self.handoff.prebound[token]
        self.releaser.hand_over(
            token, entry.fence, Outcome.WORKER_LOST, key=entry.key, name="", contended=False, on_loop=False
        )

    # -- admission (consumer loop thread) --------------------------------------------------------------

    def execute(self, request: Any, submit: Callable[[], Any]) -> Any:
        """Admit ``request`` now that a pool process can start it: run it, or park / drop it and free the
        pool slot (raising ``TaskRevokedError`` makes Celery release its pool semaphore, nothing else).

        Every start is bound by one guarded statement now (D14): an ordinary admission, the bind of a
        promotion's nonce, or the confirmation of a promotion bound here earlier (D4) whose claim must still be
        this worker's with the same fence. Whatever the message holds, nothing raises into the consumer loop
        (D16): what cannot be computed or admitted is a recorded rejection with a ``KeyedRejected`` result."""
        try:
            arrival = getattr(request, "keyed_arrival", None) or intake.arrival_for(request)
        except Exception as exc:  # D16: anything computed from the message (keys, headers, integers)
            detail = f"malformed keys: {exc}" if isinstance(exc, InvalidKey) else intake.unkeyable(exc)
            self._finish_without_running(request, "rejected", detail, record_in_ledger=True)
            metrics.admission("rejected")
            raise TaskRevokedError(request.id) from None
        if arrival is None:  # this call carries no key after all: Celery's own path
            return submit()
        if request.id in worker_state.revoked:
            # Celery's own check, made before admission: a revoked request takes no slot. (Celery would discard
            # it right after we claimed one, leaving the claim unused until the never-started sweep.) A promotion
            # meant for it is taken and given back as revoked, so that it does not go back in line.
            if arrival.token not in self.handoff.prebound and not self.breaker.is_open:
                with contextlib.suppress(*UNREACHABLE):
                    fence = self._bind_promoted(request, arrival)
                    if fence is not None:
                        with self.lock:
                            self.handoff.prebound[arrival.token] = Prebound(fence, arrival.key)
            self.handoff.revoked_before_start(arrival.token, arrival.key)
            request.revoked()  # Celery's bookkeeping: ack, REVOKED result, task_revoked signal
            raise TaskRevokedError(request.id)
        if self.breaker.is_open:
            self.breaker.hold(request)
            raise TaskRevokedError(request.id)
        request.keyed_arrival_key = arrival.key
        fresh = self.handoff.take_fresh_entry(arrival.token)
        if fresh is not None:
            # A promotion this worker's own release bound to it moments ago (D4), or a claim taken ahead at receipt:
            # its claim provably cannot have lapsed (``Handoff.take_fresh_entry``), so it starts now, on the loop,
            # with no round trip (D14).
            ahead = Admission(Verdict.ADMITTED, fence=fresh.fence) if fresh.ahead else None
            self._conclude(request, arrival, fresh.fence, ahead, since=fresh.granted)
            try:
                return submit()
            except TaskRevokedError:  # Celery's own check: revoked or expired meanwhile
                self.release(request, Outcome.REVOKED)
                raise
        admission_service = self.admission
        if admission_service is not None and admission_service.submit(
            Job(request, arrival, submit, extra={"generation": self.generation})
        ):
            return None  # decided off the loop; the pool semaphore stays taken for it until then
        sent = time.monotonic()
        try:
            fence, admission = self._claim(request, arrival)
        except UNREACHABLE as exc:
            self.breaker.open(exc)
            self.breaker.hold(request)
            raise TaskRevokedError(request.id) from None
        except Exception as exc:  # D16: the ledger refused the message's data (a value out of range...)
            self._refused(request, exc)
            raise TaskRevokedError(request.id) from None
        if not self._conclude(request, arrival, fence, admission, since=sent):
            raise TaskRevokedError(request.id)
        return submit()

    def _claim(self, request: Any, arrival: Arrival) -> tuple[int | None, Admission | None]:
        """The ledger's part of an admission (any thread): confirm a promotion bound here earlier (D14), bind a
        promotion's nonce (D5), or admit the arrival. (fence, None) for a bound promotion, else (None, admission)."""
        fence = self.handoff.confirm_prebound(arrival.token)
        if fence is None:
            fence = self._bind_promoted(request, arrival)
        if fence is not None:
            return fence, None
        return None, self.ledger.admit(arrival)

    def _refused(self, request: Any, exc: BaseException) -> None:
        info = (type(exc), exc, exc.__traceback__)
        logger.error("celery-keyed: could not admit %s[%s]", request.name, request.id, exc_info=info)
        self._finish_without_running(request, "rejected", intake.unkeyable(exc), record_in_ledger=True)
        metrics.admission("rejected")

    def _conclude(
        self,
        request: Any,
        arrival: Arrival,
        fence: int | None,
        admission: Admission | None,
        *,
        since: float | None = None,
    ) -> bool:
        """Loop thread: act on a decided admission. True: the request holds a slot (``fence``) and is tracked;
        the caller starts it. False: parked, dropped or refused (acked and announced here). ``since``: the monotonic
        time taken before the ledger call that gave the claim its lease (``Running.lease_from``)."""
        metrics.started(arrival.token, None if admission is None else admission.verdict)
        if admission is not None and admission.cancels:  # newest wins: older attempts were asked to stop
            self.pass_on_cancels(admission.cancels, f"superseded by {arrival.task_id} (newest wins)")
        if admission is None:  # bound a promotion: the key has a line
            self.releaser.mark_contended(arrival.key)
        if admission is not None and admission.promotions:  # waiters ahead of it started with the room it found
            self.dispatch(list(admission.promotions), local=True)
        if admission is not None:
            if admission.verdict is Verdict.ADMITTED:
                fence = admission.fence
            else:
                self._not_admitted(request, admission)
                return False
        assert fence is not None
        self._track(request, arrival.token, fence, since=since, arrival=arrival)
        request._request_dict[HEADER_FENCE] = fence  # the task reads it (self.request.keyed_fence, D7)
        return True

    def _track(
        self, request: Any, token: Token, fence: int, *, since: float | None = None, arrival: Arrival | None = None
    ) -> None:
        """Any thread: ``request`` holds the claim (token, fence); the heartbeat renews it from now on. ``since``:
        the monotonic time taken before the call that gave it its lease (unknown: now, which is later)."""
        if request.keyed_claim == (token, fence):
            return
        request.keyed_claim = (token, fence)
        entry = Running(request, token, fence) if since is None else Running(request, token, fence, lease_from=since)
        with self.lock:
            self.running[token] = entry
        self.heartbeat.failover.remember(HeldClaim(token.task_id, token.attempt, fence), arrival)  # D20

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
        metrics.debounced(admission)
        if admission.verdict is Verdict.PARKED:
            key = request.keyed_arrival_key
            self.releaser.mark_contended(key)
            request.acknowledge()  # the parked row is committed: the ledger holds the message now
            self.heartbeat.failover.journal_parked(request)  # D20: published again if a failover loses its row
            worker_state.task_ready(request)
            self._announce_parked(request.id, request.name, key)
            for task_id in admission.superseded:
                self.sweeper.store_never_ran(task_id, "superseded", f"replaced by {request.id}", None)
        elif admission.verdict is Verdict.DUPLICATE:
            logger.info(
                "celery-keyed: duplicate delivery of %s[%s] dropped (%s)", request.name, request.id, admission.detail
            )
            request.acknowledge()
            worker_state.task_ready(request)
        else:
            self._finish_without_running(request, admission.verdict.value, admission.detail)

    def refuse_malformed(self, task_id: str, task_name: str, detail: str, task: Any) -> None:
        """A keyed message Celery could not even build a request from (``KeyedRequest``): recorded as rejected, its
        ``KeyedRejected`` result stored, announced. Celery's consumer then rejects the message. Never raises."""
        logger.error("celery-keyed: %s[%s] rejected: %s", task_name, task_id[:300], detail)
        with contextlib.suppress(sa.exc.SQLAlchemyError, LedgerError):
            self.ledger.reject_unkeyable(task_id, task_name=task_name, detail=detail)
        try:
            backend = task.backend if task is not None else self.app.backend
            backend.mark_as_failure(task_id, exceptions.KeyedRejected(detail), store_result=True)
        except Exception:
            logger.exception("celery-keyed: could not store the rejected result of %s", task_id[:300])
            return
        with contextlib.suppress(Exception):
            self.announce_never_ran(task_id, "rejected", detail, task_name, None)
        with contextlib.suppress(sa.exc.SQLAlchemyError, LedgerError):
            self.ledger.mark_notified([task_id])

    def _finish_without_running(
        self, request: Any, outcome: str, detail: str, *, record_in_ledger: bool = False
    ) -> None:
        """Record (when asked), store the failure result, ack. Never raises: it runs on the consumer loop for
        hostile messages too (D16). A result that could not be stored is stored later from the books (the
        row stays unnotified and the sweeper retries it)."""
        if record_in_ledger:
            with contextlib.suppress(sa.exc.SQLAlchemyError, LedgerError):
                self.ledger.reject_unkeyable(request.id, task_name=request.name, detail=detail)
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
        self.announce_never_ran(request.id, outcome, detail, request.name, getattr(request, "keyed_arrival_key", None))
        if stored:
            with contextlib.suppress(sa.exc.SQLAlchemyError, LedgerError):
                self.ledger.mark_notified([request.id])

    # -- admission off the loop (celery_keyed/worker/admission.py) ---------------------------------------

    def _decide(self, jobs: Sequence[Job]) -> None:
        """The admission thread: decide a batch. Promotions (bound earlier, or carrying a nonce) are bound one by
        one (a guarded statement each, D14); the ordinary arrivals in one ``admit_many``, in the order they
        reached the pool. A claim is tracked (renewed by the heartbeat) from the moment it is taken. Arrivals
        handed over at receipt (``receive``) are parked or left alone (``Ledger.park_at_receipt``)."""
        plain: list[Job] = []
        sent = time.monotonic()  # before any call of this batch: a lower bound of every claim's lease start
        self._decide_received([job for job in jobs if job.extra.get("receipt")])
        for job in jobs:
            if job.extra.get("receipt"):
                continue
            try:
                fence = self.handoff.confirm_prebound(job.arrival.token)
                if fence is None:
                    fence = self._bind_promoted(job.request, job.arrival)
            except Exception as exc:
                job.error = exc
                continue
            if fence is not None:
                job.result = (fence, None)
                self._track(job.request, job.arrival.token, fence, since=sent, arrival=job.arrival)
            else:
                plain.append(job)
        if not plain:
            return
        admissions: list[Admission | None]
        try:
            admissions = list(self._admit_many([job.arrival for job in plain]))
        except UNREACHABLE as exc:
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
                self._track(job.request, job.arrival.token, admission.fence, since=sent, arrival=job.arrival)

    def _decide_received(self, jobs: list[Job]) -> None:
        """The receipt service's thread: the jobs handed over at receipt, in the order they were received: runs of
        parks (``_park_received``) and of claims ahead (``_claim_ahead``); requests handed on in order
        (``_pass_job``) need no ledger call."""
        run: list[Job] = []
        for job in [*jobs, None]:
            ahead = job is not None and bool(job.extra.get("ahead"))
            if job is not None and job.extra.get("pass"):
                continue
            if run and (job is None or ahead != bool(run[0].extra.get("ahead"))):
                if run[0].extra.get("ahead"):
                    self._claim_ahead(run)
                else:
                    self._park_received(run)
                run = []
            if job is not None:
                run.append(job)

    def _claim_ahead(self, jobs: list[Job]) -> None:
        """The receipt service's thread: admit the arrivals whose slots are claimed ahead (``_ahead_job``) in one
        ``admit_many``; each claim goes to ``Handoff.prebound`` at once (renewed by the heartbeat from now on, given
        back at shutdown), with the monotonic time taken before the call (``Prebound.granted``: its lease holds until
        ``granted + lease - self_fence_margin``)."""
        granted = time.monotonic()
        try:
            admissions = self._admit_many([job.arrival for job in jobs])
        except Exception as exc:  # unreachable (D9) or a bug: each is admitted as usual when a pool process is ready
            for job in jobs:
                job.error = exc
            return
        late: list[tuple[Arrival, int]] = []
        for job, admission in zip(jobs, admissions, strict=True):
            job.result = (None, admission)
            if admission.verdict is Verdict.ADMITTED and admission.fence is not None:
                # Under the lock that shutdown's give-back takes: a claim decided after the consumer stopped (its
                # thread outlived the stop's wait, under load) is given back here, never left for nobody to renew.
                with self.lock:
                    stale = self.closed or self.stopping.is_set() or job.extra.get("generation") != self.generation
                    if not stale:
                        self.handoff.prebound[job.arrival.token] = Prebound(
                            admission.fence, job.arrival.key, granted=granted, ahead=True
                        )
                if stale:
                    late.append((job.arrival, admission.fence))
        for arrival, fence in late:
            self.releaser.hand_over(
                arrival.token, fence, Outcome.WORKER_LOST, key=arrival.key, name="", contended=False, on_loop=False
            )

    def _park_received(self, jobs: list[Job]) -> None:
        """The receipt service's thread: park the arrivals handed over at receipt, in one round trip for a batch
        (``Ledger.park_many_at_receipt``: one transaction each, in the order they were received)."""
        if not jobs:
            return
        park_many = getattr(self.ledger, "park_many_at_receipt", None)
        if park_many is None or len(jobs) == 1:
            for job in jobs:
                try:
                    job.result = (None, self.ledger.park_at_receipt(job.arrival))
                except Exception as exc:
                    job.error = exc
            return
        try:
            answers = park_many([job.arrival for job in jobs])
        except Exception as exc:
            for job in jobs:
                job.error = exc
            return
        for job, answer in zip(jobs, answers, strict=True):
            if isinstance(answer, BaseException):
                job.error = answer
            else:
                job.result = (None, answer)

    def _admit_many(self, arrivals: list[Arrival]) -> list[Admission]:
        admit_many = getattr(self.ledger, "admit_many", None)
        if admit_many is not None and len(arrivals) > 1:
            return list(admit_many(arrivals))
        return [self.ledger.admit(arrival) for arrival in arrivals]

    def _deliver(self, jobs: list[Job]) -> None:
        """The admission thread: hand the decided batch to the loop."""
        self.handoff.call_on_loop(lambda: self._admitted(jobs))

    def _admitted(self, jobs: list[Job]) -> None:
        """Loop thread: start the admitted requests of a decided batch in the pool processes kept for them; ack,
        park or drop the others and give their pool process back. Then the requests still waiting for a pool process
        whose key became busy here meanwhile are parked without one (``park_waiting``).

        The pool processes the batch gives back are given back after ``park_waiting``, not as each verdict is acted
        on: given back at once, a parked request's process went straight to the next request of its key waiting in
        the pool semaphore's line, whose admission was then under way while ``park_waiting`` looked (D10 keeps a
        key with a request in admission flight where it is), so a burst of one key's arrivals was parked one at a
        time, each holding a pool process for its round trip (bench.gate c: an admission every ~5 ms beside the
        key's handoffs, which waited on the same rows)."""
        self._returned = 0
        frees: list[Callable[[], None]] = []
        self._frees = frees
        try:
            for job in jobs:
                try:
                    self._start_decided(job)
                except Exception:
                    logger.exception("celery-keyed: could not act on the admission of %s", job.request.id)
            self.park_waiting()
        finally:
            self._frees = None
            for free in frees:
                try:
                    free()
                except Exception:
                    logger.exception("celery-keyed: could not give a pool process back")

    def _start_decided(self, job: Job) -> None:
        if job.extra.get("receipt"):
            self._received(job)
            return
        request = job.request
        # The consumer stopped since the hand-over (a broker reconnect, shutdown): Celery has reset its pool
        # semaphore and forgotten the request; its unacked message comes back from the broker.
        stale = self.stopping.is_set() or self.closed or job.extra.get("generation") != self.generation
        free = (lambda: None) if stale else self._free_pool_slot
        if job.error is not None:
            free()
            if isinstance(job.error, UNREACHABLE):
                self.breaker.open(job.error)
                if not stale:
                    self.breaker.hold(request)
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
        with self.lock:
            self.running.pop(claim[0], None)
        self.releaser.hand_over(
            claim[0], claim[1], outcome, key=request.keyed_arrival_key, name=request.name, contended=True, on_loop=False
        )

    def _free_pool_slot(self) -> None:
        """Give back the pool semaphore Celery took for a request that does not start after all (what raising
        ``TaskRevokedError`` from ``execute_using_pool`` does on the loop's own path); while a decided batch is
        acted on (``_admitted``), once the batch is done."""
        if self._pool_release is None:
            return
        if self._frees is not None:
            self._frees.append(self._pool_release)
            return
        self._pool_release()

    @contextlib.contextmanager
    def _service_thread(self) -> Iterator[None]:
        """The admission and receipt threads' context for their lifetime: one ledger connection kept between
        calls (``Ledger.pinned``), taken at the first call and warmed up once keyed work was seen
        (``_warm_services``)."""
        with self.ledger.pinned():
            yield

    def _warm_services(self) -> None:
        """Loop thread, at each keyed arrival (a flag test after the first): the first one asks the admission,
        receipt and releaser threads to warm their ledger connections up (``Ledger.warm_up``), in parallel, while
        this request is on its way to a pool process (its admission waits for the admission thread's warm-up once,
        where it would otherwise pay the cold connection's first use itself). Not at the worker's start: a worker
        that only ever runs plain tasks opens no connection for them and runs no warm-up (warmed at start, a quick
        bench.gate a of 500 plain tasks ran 10-20 % slower with the gate installed: 0.80-0.98 against 0.95-1.22)."""
        if self._warm_requested:
            return
        self._warm_requested = True
        for service in (self.admission, self.receipts):
            if service is not None:
                service.request_warm()
        self.releaser.request_warm()

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

    # -- release (the outcome hooks, on the consumer loop; then the releaser) ---------------------------

    def release(
        self, request: Any, outcome: Outcome, *, uncertain: bool = False, on_loop: bool = True, detail: str = ""
    ) -> None:
        """Give back the slot of ``request`` after ``outcome``; idempotent (the hooks may fire twice). Called only
        once its body has provably stopped (D17): the pool reported the job's result or the process's exit; a hard
        time limit's release waits for that exit (``ExitWatch``, worker/exits.py). ``uncertain``: a hard time limit
        or a lost worker ended it; an uncertain hold may keep its slots. ``on_loop=False``: the caller is not the
        consumer loop's thread (the exit watch). ``detail``: recorded with a final outcome.

        The loop only forgets the claim and hands the release to the releaser (worker/releaser.py), whose
        thread runs the ledger's transaction on a connection of its own. Its promotions to run here come back
        to the loop already bound to this worker (D4). Without a running releaser (not started, or stopped at
        shutdown) the release runs in the caller's thread."""
        ack = request.keyed_take_deferred_ack() if hasattr(request, "keyed_take_deferred_ack") else None
        claim = request.keyed_claim
        if claim is None:
            if ack is not None:
                ack()
            return
        request.keyed_claim = None
        token, fence = claim
        superseded_by = getattr(request, "keyed_cancelled", None)
        if superseded_by is not None:
            # Newest wins: the cancel a newer arrival asked for reached this attempt (its pool process was terminated,
            # or its keyed_cancelled() flag raised) before its outcome: it is recorded superseded however it ended.
            outcome, uncertain, detail = Outcome.SUPERSEDED, False, superseded_by
            metrics.newest_wins("superseded")
        with self.lock:
            entry = self.running.pop(token, None)
            self.releasing += 1
        if entry is not None:
            self.handoff.note_run(time.monotonic() - entry.claimed_at)
        try:
            key = getattr(request, "keyed_arrival_key", None)
            hold = getattr(request.task, "uncertain_hold", None) if uncertain else None
            self.releaser.hand_over(
                token,
                fence,
                outcome,
                key=key,
                name=request.name,
                contended=self.releaser.is_contended(key),
                uncertain=uncertain,
                hold=hold,
                after=ack,
                on_loop=on_loop,
                detail=detail,
            )
        finally:
            with self.lock:
                self.releasing -= 1
        if entry is not None:
            try:  # after the release is handed over: nothing here may keep a slot from going back
                self.fit_prefetch()
            except Exception:
                logger.exception("celery-keyed: could not fit the prefetch window")

    # -- newest wins (on_newer="cancel_running", issue 14 item 1) ----------------------------------------------

    def cancelled(self, task_id: str, attempt: int) -> bool:
        """Any thread (the task's own, on the threads pool): whether the attempt runs here and a newer arrival's cancel
        reached it (``KeyedTask.keyed_cancelled``)."""
        if os.getpid() != self.pid:  # a prefork pool process forked after the gate started: a stale copy
            return False
        with self.lock:
            entry = self.running.get(Token(task_id, attempt))
        return entry is not None and entry.cancelled is not None

    def cancel_running(self, entries: Iterable[tuple[Running, str]]) -> None:
        """Heartbeat thread (or the cancel broadcast, on the loop): pass newer arrivals' cancel requests on to the
        attempts this process runs. Prefork: the pool process is terminated (on the consumer loop, where Celery's own
        terminate runs; an attempt whose outcome came first keeps it). Other pools: ``keyed_cancelled()`` turns true
        and the body stops when it polls it. Either way the attempt's release records ``superseded``."""
        prefork = self.heartbeat.can_terminate()
        for entry, detail in entries:
            if entry.cancelled is not None:
                continue
            entry.cancelled = detail
            if not prefork:
                entry.request.keyed_cancelled = detail
                metrics.newest_wins("cancelled")
                logger.info("celery-keyed: %s[%s] asked to stop: %s", entry.request.name, entry.token.task_id, detail)
                continue
            self.handoff.call_on_loop(functools.partial(self._terminate, entry, detail))

    def _terminate(self, entry: Running, detail: str) -> None:
        """Loop thread: terminate a prefork attempt a newer arrival cancelled, unless its outcome came first (its
        outcome hooks run on this thread too: then its claim is gone and it keeps its own outcome).

        Its pool process gets SIGTERM through the pool (``terminate_job``), and nothing else happens here: when the
        pool has seen that process **exit**, it fails the attempt (``Terminated``), whose release (outcome superseded)
        frees the slot. So the newest never starts while the old body may still run — Celery's own
        ``Request.terminate`` fails the attempt at once, before the process is gone. Not started yet (no pool
        process): the next heartbeat tries again."""
        request = entry.request
        if request.keyed_claim is None or request.keyed_claim[0] != entry.token:
            return
        pid = getattr(request, "worker_pid", None)
        pool = getattr(self.consumer, "pool", None)
        if not pid or pool is None:
            entry.cancelled = None
            return
        request.keyed_cancelled = detail
        metrics.newest_wins("cancelled")
        logger.info("celery-keyed: terminating %s[%s] (pool process %s): %s", request.name, entry.token.task_id, pid,
                    detail)
        try:
            pool.terminate_job(pid, SIGTERM)
        except Exception:
            logger.exception("celery-keyed: could not terminate %s[%s]", request.name, entry.token.task_id)

    def pass_on_cancels(self, cancels: Iterable[tuple[str, int, str | None]], detail: str) -> None:
        """Loop thread: an admission (committed) asked older attempts to stop (newest wins). Those this process runs
        are cancelled now; the others' workers are told by the ``keyed_cancel`` broadcast (each holder's heartbeat
        finds the request within ``keyed_heartbeat_interval`` anyway, so a lost broadcast only delays it)."""
        cancels = list(cancels)
        metrics.newest_wins("requested", len(cancels))
        with self.lock:
            here = [(self.running[Token(t, a)], detail) for t, a, h in cancels if Token(t, a) in self.running]
        self.cancel_running(here)
        others = [[t, a, h] for t, a, h in cancels if h is not None and h != self.ledger.holder]
        if not others:
            return
        try:
            self.app.control.broadcast("keyed_cancel", arguments={"claims": others})
        except Exception:
            logger.warning("celery-keyed: could not broadcast keyed_cancel; the holders' heartbeats will find it")

    def check_cancels(self, holder_claims: Iterable[tuple[str, int, str | None]] | None = None) -> None:
        """Ask the ledger which attempts this process runs have a cancel pending, and pass them on. ``holder_claims``:
        when given (the broadcast), only those of this holder are looked at, and nothing is read unless one is."""
        with self.lock:
            running = list(self.running.values())
        if holder_claims is not None:
            wanted = {(t, int(a)) for t, a, h in holder_claims if h == self.ledger.holder}
            running = [r for r in running if (r.token.task_id, r.token.attempt) in wanted]
        running = [r for r in running if r.cancelled is None and _cancellable(r.request)]
        if not running:
            return
        held = {HeldClaim(r.token.task_id, r.token.attempt, r.fence): r for r in running}
        requested = self.ledger.cancel_requested(held)
        self.cancel_running((held[claim], detail) for claim, detail in requested.items())

    # -- inspection (``celery keyed inspect``, through Celery's remote control) ----------------------------

    def snapshot(self) -> dict[str, Any]:
        """What this gate holds now, JSON-able: running attempts, promotions handed here waiting for a pool
        process, requests held while the ledger is unreachable, releases not committed yet, the breaker."""
        now = time.monotonic()
        with self.lock:
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
                    "cancelled": r.cancelled,
                }
                for r in self.running.values()
            ]
            prebound = [
                {
                    "task_id": t.task_id,
                    "attempt": t.attempt,
                    "fence": p.fence,
                    "key": p.key,
                    "waiting_for": round(now - p.since, 3),
                }
                for t, p in self.handoff.prebound.items()
            ]
        return {
            "holder": self.ledger.holder,
            "ledger_reachable": not self.breaker.is_open,
            "shutting_down": self.closed,
            "running": running,
            "handed_over": prebound,
            "held": [{"task_id": r.id, "task": r.name} for r in list(self.breaker.held)],
            "pending_releases": [
                {"task_id": j.token.task_id, "attempt": j.token.attempt, "outcome": j.outcome.value}
                for j in list(self.releaser.pending)
            ],
            "pending_revokes": list(self.revokes.pending),
            "last_renewal_ago": round(now - self.heartbeat.last_renewal, 3),
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
        elif self.handoff.loop_runs():
            self.handoff.defer(lambda: self._emit(event_type, **fields))

    def _announce_parked(self, task_id: str, task_name: str, key: str | None) -> None:
        logger.debug("celery-keyed: %s[%s] parked in the line of %s", task_name, task_id, key)
        signals.keyed_parked.send(sender=self, task_id=task_id, task_name=task_name, key=key)
        self._emit("task-keyed-parked", uuid=task_id, name=task_name, key=key)

    def announce_promoted(self, promotion: Promotion, *, local: bool) -> None:
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

    def announce_never_ran(self, task_id: str, outcome: str, detail: str, task_name: str, key: str | None) -> None:
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
