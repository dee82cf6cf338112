"""The consumer gate of one worker process: the wiring and the lifecycle of the worker's services
(celery_keyed/worker/, listed in its ``__init__``), owned by the ``KeyedGate`` consumer bootstep (bootstep.py).
docs/worker.md draws the services, their threads and their state.

``GateService`` builds each service with what it needs (the ledger, the settings, the running table and its lock,
the lifecycle, the handoff, callbacks), starts and stops them with the consumer (start / stop / shutdown / close),
and keeps the doors the bootstep, the request class and the tests use. No service imports this module
(.importlinter). Its own fields: ``lock`` (guards the running table and ``handoff.prebound``), ``running`` (token ->
``Running``, shared with the services), ``life`` (``closed``, ``stopping``, ``generation``, ``started_at``,
``timers``: written here, on Celery's thread, read by every thread).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import sqlalchemy as sa
from celery.worker.strategy import default as default_strategy

from celery_keyed import metrics
from celery_keyed.access import ledger_on
from celery_keyed.engine import create_ledger_engine
from celery_keyed.ledger import Arrival, Promotion, Token, new_holder
from celery_keyed.settings import KeyedSettings
from celery_keyed.task import set_cancel_probe
from celery_keyed.worker import intake
from celery_keyed.worker.admission import AdmissionService
from celery_keyed.worker.breaker import Breaker
from celery_keyed.worker.cancels import Cancels
from celery_keyed.worker.decide import Decide
from celery_keyed.worker.events import Events, warn_prefix_capture
from celery_keyed.worker.exits import ExitWatch, pool_processes
from celery_keyed.worker.finish import Finish
from celery_keyed.worker.handoff import Handoff
from celery_keyed.worker.heartbeat import Heartbeat
from celery_keyed.worker.prefetch import Prefetch
from celery_keyed.worker.receipt import AHEAD_LINGER, DECLINE_MEMORY, Receipt
from celery_keyed.worker.releaser import Releaser
from celery_keyed.worker.revokes import Revokes
from celery_keyed.worker.running import Lifecycle, Running
from celery_keyed.worker.start import Start, pool_semaphore_release
from celery_keyed.worker.sweeper import Sweeper
from celery_keyed.worker.verdicts import Verdicts

__all__ = ["AHEAD_LINGER", "DECLINE_MEMORY", "GateService", "Running", "current_gate", "keyed_strategy"]

logger = logging.getLogger("celery_keyed")

#: Threads of a worker process that keep one ledger connection each for their lifetime (``Ledger.pinned``): the
#: admission, receipt and releaser threads. The engine's pool keeps that many connections more than
#: ``keyed_pool_size``.
PINNED_THREADS = 3

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


class _Life:
    """A field of the lifecycle read and written as the gate's own (``gate.closed``...)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, gate: Any, owner: Any = None) -> Any:
        return self if gate is None else getattr(gate.life, self.name)

    def __set__(self, gate: Any, value: Any) -> None:
        setattr(gate.life, self.name, value)


#: The services that keep their own reference to the consumer or the settings (set again when the gate's change).
_HOLDS_CONSUMER = ("heartbeat", "handoff", "breaker", "receipt", "cancels", "events", "prefetch")
_HOLDS_SETTINGS = ("heartbeat", "handoff", "breaker", "sweeper", "receipt", "prefetch")


class GateService:
    """The gate of one worker process: its services, wired, and their lifecycle."""

    closed = _Life("closed")
    stopping = _Life("stopping")
    generation = _Life("generation")
    started_at = _Life("started_at")
    timers = _Life("timers")
    _loop_thread = _Life("loop_thread")

    def __init__(self, app: Any, consumer: Any, settings: KeyedSettings) -> None:
        self.app = app
        self._consumer = consumer
        self._settings = settings
        self.engine = create_ledger_engine(settings, pinned=PINNED_THREADS)
        self.ledger = ledger_on(self.engine, settings, holder=new_holder(getattr(consumer, "hostname", None)))
        self.lock = threading.Lock()
        self.life = Lifecycle()
        self.pid = os.getpid()  # the worker's main process (pool processes forked later inherit a copy of the gate)
        self.running: dict[Token, Running] = {}
        self.handoff = Handoff(
            app=app, settings=settings, consumer=consumer, ledger=self.ledger, life=self.life, lock=self.lock
        )
        self.breaker = Breaker(ledger=self.ledger, settings=settings, consumer=consumer, handoff=self.handoff)
        self.releaser = Releaser(ledger=self.ledger, handoff=self.handoff, breaker=self.breaker, life=self.life)
        self.exits = ExitWatch(lambda: pool_processes(self.consumer))  # releases held until a body stopped (D17)
        self.sweeper = Sweeper(
            app=app, settings=settings, ledger=self.ledger, breaker=self.breaker, handoff=self.handoff,
            announce_never_ran=lambda *args: self.events.announce_never_ran(*args),  # events: built below
        )  # fmt: skip
        self.revokes = Revokes(
            ledger=self.ledger, breaker=self.breaker, dispatch=self.handoff.dispatch,
            notify_never_ran=self.sweeper.notify_never_ran,
        )  # fmt: skip
        self.heartbeat = Heartbeat(
            settings=settings, consumer=consumer, ledger=self.ledger, life=self.life, lock=self.lock,
            running=self.running, handoff=self.handoff, releaser=self.releaser, breaker=self.breaker,
            revokes=self.revokes,
        )  # fmt: skip
        self.releaser.on_released = self.heartbeat.failover.journal_released  # D20: given again if a failover loses it
        self._warm_requested = False  # loop only: ``_warm_services`` asked once
        self._wire()

    def _wire(self) -> None:
        """Build the services of the keyed path, each with its collaborators, and open the gate's doors on them."""
        shared: dict[str, Any] = {"lock": self.lock, "running": self.running}
        self.events = Events(
            sender=self, consumer=self.consumer, life=self.life, handoff=self.handoff, ledger=self.ledger,
            breaker=self.breaker, releaser=self.releaser, revokes=self.revokes, heartbeat=self.heartbeat, **shared,
        )  # fmt: skip
        self.prefetch = Prefetch(
            consumer=self.consumer, settings=self.settings, life=self.life, lock=self.lock, handoff=self.handoff,
            breaker=self.breaker,
        )  # fmt: skip
        self.cancels = Cancels(
            app=self.app, consumer=self.consumer, ledger=self.ledger, handoff=self.handoff,
            can_terminate=self.heartbeat.can_terminate, **shared,
        )  # fmt: skip
        self.finish = Finish(
            handoff=self.handoff, releaser=self.releaser, exits=self.exits, fit_prefetch=self.prefetch.fit_prefetch,
            **shared,
        )  # fmt: skip
        self.verdicts = Verdicts(
            app=self.app, ledger=self.ledger, releaser=self.releaser, sweeper=self.sweeper,
            announce_parked=self.events._announce_parked, announce_never_ran=self.events.announce_never_ran,
            journal_parked=self.heartbeat.failover.journal_parked,
        )  # fmt: skip
        remember = self.heartbeat.failover.remember
        self.decisions = Decide(
            ledger=self.ledger, life=self.life, handoff=self.handoff, releaser=self.releaser, remember=remember,
            **shared,
        )  # fmt: skip
        verdicts: dict[str, Any] = {
            "not_admitted": self.verdicts._not_admitted,
            "finish_without_running": self.verdicts._finish_without_running,
        }
        self.receipt = Receipt(
            settings=self.settings, consumer=self.consumer, ledger=self.ledger, life=self.life, handoff=self.handoff,
            releaser=self.releaser, breaker=self.breaker, warm=self._warm_services, dispatch=self.handoff.dispatch,
            pass_on_cancels=self.cancels.pass_on_cancels, **verdicts, **shared,
        )  # fmt: skip
        self.starts = Start(
            ledger=self.ledger, life=self.life, handoff=self.handoff, releaser=self.releaser, breaker=self.breaker,
            bind_promoted=self.decisions._bind_promoted, received=self.receipt._received,
            park_waiting=self.receipt.park_waiting, pass_on_cancels=self.cancels.pass_on_cancels,
            dispatch=self.handoff.dispatch, release=self.finish.release, give_back=self.finish._give_back,
            remember=remember, **verdicts, **shared,
        )  # fmt: skip
        handoff = self.handoff  # the collaborators it needs that were built after it
        handoff.releaser, handoff.breaker, handoff.revokes = self.releaser, self.breaker, self.revokes
        handoff.park_waiting, handoff.held_mutex_keys = self.receipt.park_waiting, self.receipt.held_mutex_keys
        handoff.announce_promoted = self.events.announce_promoted
        self.heartbeat.check_cancels = self.cancels.check_cancels
        # The doors (bootstep, request class, the other services, tests).
        self.receive = self.receipt.receive
        self.park_waiting = self.receipt.park_waiting
        self.held_mutex_keys = self.receipt.held_mutex_keys
        self.execute = self.starts.execute
        self._decide = self.decisions._decide
        self._deliver = self.starts._deliver
        self.release = self.finish.release
        self.release_unstarted = self.finish.release_unstarted
        self.refuse_malformed = self.verdicts.refuse_malformed
        self.cancelled = self.cancels.cancelled
        self.cancel_running = self.cancels.cancel_running
        self.pass_on_cancels = self.cancels.pass_on_cancels
        self.check_cancels = self.cancels.check_cancels
        self.snapshot = self.events.snapshot
        self.announce_promoted = self.events.announce_promoted
        self.announce_never_ran = self.events.announce_never_ran
        self.widen_prefetch = self.prefetch.widen_prefetch
        self.fit_prefetch = self.prefetch.fit_prefetch

    @property
    def consumer(self) -> Any:
        return self._consumer

    @consumer.setter
    def consumer(self, consumer: Any) -> None:  # the bootstep sets it at every consumer start
        self._consumer = consumer
        for name in _HOLDS_CONSUMER:
            if hasattr(self, name):
                getattr(self, name).consumer = consumer

    @property
    def settings(self) -> KeyedSettings:
        return self._settings

    @settings.setter
    def settings(self, settings: KeyedSettings) -> None:
        self._settings = settings
        for name in _HOLDS_SETTINGS:
            if hasattr(self, name):
                getattr(self, name).settings = settings

    @property
    def admission(self) -> AdmissionService | None:
        """Admission off the loop (worker/admission.py): on when the pool semaphore keeps a pool process for a
        request while its admission is decided (prefork on the event loop); else admission runs on the loop."""
        return self.starts.admission

    @admission.setter
    def admission(self, service: AdmissionService | None) -> None:
        self.starts.admission = service

    @property
    def receipts(self) -> AdmissionService | None:
        """Park at receipt (``receive``): a thread of its own, so that a burst of parks never queues in front of the
        admissions of requests a pool process is kept for."""
        return self.receipt.receipts

    @receipts.setter
    def receipts(self, service: AdmissionService | None) -> None:
        self.receipt.receipts = self.prefetch.receipts = service

    @property
    def releasing(self) -> int:
        """Releases between leaving ``running`` and the releaser's hands (``Finish.releasing``)."""
        return self.finish.releasing

    @property
    def _at_receipt(self) -> dict[str, int]:
        return self.receipt._at_receipt

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
            warn_prefix_capture(self.ledger, self.settings.limits)
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
        self.starts._pool_release = pool_release = pool_semaphore_release(self.consumer)
        if hub is not None and pool_release is not None and self.settings.admission_batch > 0:
            if self.admission is None:
                self.admission = AdmissionService(
                    self.decisions._decide, self.starts._deliver, batch=self.settings.admission_batch,
                    thread_context=self._service_thread, warm=self.ledger.warm_up,
                )
            self.admission.start()
            if self.settings.park_at_receipt:
                if self.receipts is None:
                    self.receipts = AdmissionService(
                        self.decisions._decide, self.starts._deliver, batch=self.settings.admission_batch,
                        name="keyed-receipt",
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

    def idle(self) -> bool:
        """No attempt runs here and no release is on its way to the ledger."""
        with self.lock:
            if self.running or self.finish.releasing:
                return False
        return self.releaser.idle()

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

    # -- the admission and receipt threads -------------------------------------------------------------

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
