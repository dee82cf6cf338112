"""The receipt path (consumer loop thread; decided by the receipt service's thread): what happens to a keyed request
when Celery hands it on for a pool process, before one is ready for it. An arrival whose key has a line here is
parked at once (``keyed_park_at_receipt``), a request that will wait for a process anyway has its slot claimed ahead
(``keyed_claim_ahead``), a later request of a key with one at the receipt service is handed on after it, in order;
the requests already waiting in the pool semaphore's line of a key that became busy are parked without a process
(``park_waiting``). Then the loop acts on each verdict (``_received``).

Collaborators, given by the gate: the ledger, the settings, the consumer, the lifecycle (closed / stopping /
generation), the running table and its lock, the handoff (the claims bound here, the dispatch of promotions), the
releaser (which keys are contended), the breaker, and callbacks: ``warm`` (the pinned threads' warm-up),
``dispatch``, ``pass_on_cancels``, ``not_admitted``, ``finish_without_running``. ``receipts`` (the receipt
service's thread, worker/admission.py) is set by the gate's start.

State, all the consumer loop's: ``_at_receipt`` (key -> requests of it at the receipt service whose verdict the loop
has not acted on), ``_declined`` (nonces of promotions given back to the broker once, with when), ``_returned``
(requests sent back to the pool line's front in the current delivery).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from celery.worker import state as worker_state

from celery_keyed import metrics
from celery_keyed.engine import UNREACHABLE
from celery_keyed.headers import HEADER_KEY, HEADER_NONCE
from celery_keyed.ledger import Outcome, Token, Verdict, key_name
from celery_keyed.worker import intake
from celery_keyed.worker.poolline import join_line, pool_line, slot_holders_ahead
from celery_keyed.worker.running import FollowsLifecycle, Job, Lifecycle, Running

logger = logging.getLogger("celery_keyed")

# Seconds a worker remembers a promotion it gave back to the broker (``Receipt._decline_promotion``): delivered
# here again within them, it is kept.
DECLINE_MEMORY = 60.0

#: Most seconds a claim taken ahead waits for other arrivals to share its round trip (``AdmissionService.lingering``);
#: at most half the wait expected for a pool process. A round trip of the ledger costs far more than a task in it
#: (bench.statements --sizes). Measured on bench.gate b (1,000 uncontended keys, one worker c=2): 15 ms against 5 ms
#: takes the claim calls per task from 0.32-0.38 to 0.24-0.27; the request waits for a process meanwhile anyway.
AHEAD_LINGER = 0.015


def _receipt_keys(job: Job) -> list[str]:
    """The keys a job handed to the receipt service counts for (``Receipt._at_receipt``)."""
    keys = job.extra.get("keys")
    if keys is None:
        key = job.extra.get("key")
        keys = [key] if isinstance(key, str) else []
    return [key for key in keys if isinstance(key, str)]


def _open(service: Any, breaker: Any, closed: bool, stopping: threading.Event) -> bool:
    """Whether the receipt service takes work now: made, accepting, the ledger reachable, the consumer running."""
    return service is not None and service.accepting and not breaker.is_open and not closed and not stopping.is_set()


def _busy_in_line(
    waiting: Iterable[Any], held: set[str], bound_here: set[str], is_contended: Callable[[str], bool]
) -> tuple[list[tuple[Any, Any, str]], set[int]]:
    """The entries of the pool semaphore's line (``park_waiting``) whose request may park at receipt: keyed, one
    key, no claim, not at the receipt service or taken out before, not bound here, no nonce, and its key busy here
    (its mutex ``held``, or contended). With the ids of every request in the line (``queued``)."""
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
        if key in held or is_contended(key):
            candidates.append((entry, request, key))
    return candidates, queued


class Receipt(FollowsLifecycle):
    """The receipt path of one worker process. ``receive`` and ``park_waiting`` are its doors (loop thread)."""

    def __init__(
        self,
        *,
        settings: Any,
        consumer: Any,
        ledger: Any,
        life: Lifecycle,
        lock: threading.Lock,
        running: dict[Token, Running],
        handoff: Any,
        releaser: Any,
        breaker: Any,
        warm: Callable[[], None],
        dispatch: Callable[..., None],
        pass_on_cancels: Callable[..., None],
        not_admitted: Callable[[Any, Any], None],
        finish_without_running: Callable[..., None],
    ) -> None:
        self.settings = settings
        self.consumer = consumer
        self.ledger = ledger
        self.life = life
        self.lock = lock
        self.running = running
        self.handoff = handoff
        self.releaser = releaser
        self.breaker = breaker
        self._warm_services = warm
        self.dispatch = dispatch
        self.pass_on_cancels = pass_on_cancels
        self._not_admitted = not_admitted
        self._finish_without_running = finish_without_running
        self.receipts: Any = None  # the receipt service (worker/admission.py), set by the gate's start
        self._at_receipt: dict[str, int] = {}
        self._declined: dict[str, float] = {}
        self._returned = 0

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
        if not limit or not hasattr(request, "keyed_claim"):
            return None
        if not _open(service, self.breaker, self.closed, self.stopping):
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
        if not self.settings.park_at_receipt or not hasattr(request, "keyed_claim"):
            return None
        if not _open(admission_service, self.breaker, self.closed, self.stopping):
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
        raised the limit only costs that round trip: the receipt leaves an arrival with room to its admission.
        (``held_mutex_keys`` asked about one key, without building the set: this runs for every keyed request.)"""
        config = self.settings.limits.get(key_name(key))
        if config is not None and config.limit != 1:
            return False
        with self.lock:
            if any(bound.key == key for bound in self.handoff.prebound.values()):
                return True
            return any(
                (getattr(entry.request, "_request_dict", None) or {}).get(HEADER_KEY) == key
                for entry in self.running.values()
            )

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
        if not self.settings.park_at_receipt or not _open(admission_service, self.breaker, self.closed, self.stopping):
            return 0
        waiting = pool_line(self.consumer)
        if not waiting:
            return 0
        held = self.held_mutex_keys()
        with self.lock:  # promotions bound here (D4) wait in the same line: they start, they never park
            bound_here = {token.task_id for token in self.handoff.prebound}
        candidates, queued = _busy_in_line(waiting, held, bound_here, self.releaser.is_contended)
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
