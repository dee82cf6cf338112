"""The start when a pool process is ready (consumer loop thread): Celery's pool has a process for a keyed request
(D3). It starts at once when its claim provably holds (bound here moments ago, or claimed ahead), else is decided
on the loop or handed to the admission service (worker/admission.py, ``admission``), whose decided batches come
back to ``_admitted``; then it starts in the process kept for it, or is parked, dropped or refused and the process
given back.

Collaborators, given by the gate: the ledger, the lifecycle, the running table and its lock, the handoff, the
releaser, the breaker, and callbacks: ``bind_promoted`` and the verdicts (``not_admitted``,
``finish_without_running``), ``received`` and ``park_waiting`` (the receipt path), ``pass_on_cancels``,
``dispatch``, ``release`` and ``give_back`` (the end of an attempt). ``admission`` and ``_pool_release`` (Celery's
release of its pool semaphore) are set by the gate's start.

State, the consumer loop's: ``_frees`` (while a decided batch is acted on, the pool processes it gives back; None
otherwise).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from celery.exceptions import TaskRevokedError
from celery.worker import state as worker_state

from celery_keyed import metrics
from celery_keyed.engine import UNREACHABLE
from celery_keyed.headers import HEADER_FENCE
from celery_keyed.ledger import Admission, Arrival, InvalidKey, Outcome, Token, Verdict
from celery_keyed.worker import intake
from celery_keyed.worker.running import FollowsLifecycle, Job, Lifecycle, Prebound, Running, track

logger = logging.getLogger("celery_keyed")


def pool_semaphore_release(consumer: Any) -> Callable[[], None] | None:
    """Celery's release of the pool semaphore when the worker guards pool puts with it (prefork on the event
    loop), else None: then admission stays on the loop (no semaphore keeps a pool process for a request
    whose admission is decided elsewhere)."""
    controller = getattr(consumer, "controller", None)
    if controller is None or getattr(controller, "semaphore", None) is None:
        return None
    if getattr(controller, "process_task", None) != getattr(controller, "_process_task_sem", None):
        return None
    release = getattr(controller, "_quick_release", None)
    return release if callable(release) else None


class Start(FollowsLifecycle):
    """The start of keyed requests when a pool process is ready. ``execute`` is its door (loop thread)."""

    def __init__(
        self,
        *,
        ledger: Any,
        life: Lifecycle,
        lock: threading.Lock,
        running: dict[Token, Running],
        handoff: Any,
        releaser: Any,
        breaker: Any,
        bind_promoted: Callable[[Any, Arrival], int | None],
        not_admitted: Callable[[Any, Any], None],
        finish_without_running: Callable[..., None],
        received: Callable[[Job], None],
        park_waiting: Callable[[], int],
        pass_on_cancels: Callable[..., None],
        dispatch: Callable[..., None],
        release: Callable[..., None],
        give_back: Callable[[Any, Outcome], None],
        remember: Callable[[Any, Any], None] | None = None,
    ) -> None:
        self.remember = remember  # the failover watch's memory of what a claim holds (D20)
        self.ledger = ledger
        self.life = life
        self.lock = lock
        self.running = running
        self.handoff = handoff
        self.releaser = releaser
        self.breaker = breaker
        self._bind_promoted = bind_promoted
        self._not_admitted = not_admitted
        self._finish_without_running = finish_without_running
        self._received = received
        self.park_waiting = park_waiting
        self.pass_on_cancels = pass_on_cancels
        self.dispatch = dispatch
        self.release = release
        self._give_back = give_back
        self.admission: Any = None  # the admission service (worker/admission.py), set by the gate's start
        self._pool_release: Callable[[], None] | None = None
        self._frees: list[Callable[[], None]] | None = None

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
        track(
            self.lock, self.running, request, arrival.token, fence, since=since, remember=self.remember, arrival=arrival
        )
        request._request_dict[HEADER_FENCE] = fence  # the task reads it (self.request.keyed_fence, D7)
        return True

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
