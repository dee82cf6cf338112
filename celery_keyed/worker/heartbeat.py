"""The heartbeat and self-fencing (D7, D13): leases renewed for as long as a keyed body may run in a process we own.

Every ``keyed_heartbeat_interval`` its thread runs ``heartbeat_once``: renew the claims of the attempts this
process runs and of the promotions bound to it that wait for a pool process (never "all claims of this
hostname", D6); move each renewed attempt's ``lease_from`` to the time the renewal was *sent*; notice a slot
that was reclaimed (its attempt is no longer tracked, and is self-fenced); pass on newest-wins cancel requests of
newer arrivals to the attempts they concern (the broadcast ``keyed_cancel`` may have been lost); give back
promotions bound here that no pool process took within a heartbeat, and claims of requests admitted but never
started (D6); retry the releases and revokes that failed; probe the breaker.

Self-fencing is not the heartbeat's to decide (D19): a renewal can fail with any error or block for as long as a
silent server keeps it waiting, so the deadline is kept by ``worker.fence.SelfFence``, a thread of its own started
and stopped with the heartbeat's, which reads ``lease_from`` and stops, on the prefork pool, the pool process of
every keyed attempt that may have lost its slot (``keyed_self_fence``, on by default). The heartbeat only moves
``lease_from`` when a renewal succeeded.

Threads and fields: the heartbeat's thread belongs to the **process**, not to the consumer (D13): it starts at
the first consumer start and goes on through consumer restarts (broker reconnects), warm shutdown and broker
outages, until shutdown has begun and nothing it tracks is left (running attempts, promotions bound here,
releases not yet committed), or ``stop`` ends it now. ``last_renewal`` (the send time of the last renewal or probe
that succeeded) and ``pids`` are its thread's (``pids`` also set once by the gate's start, before the thread runs;
``last_renewal`` read by the gate's snapshot). The running table and the promotions bound here it reads under the
gate's lock; ``Running.lease_from`` it writes for the fence to read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from celery.worker import state as worker_state

from celery_keyed.engine import UNREACHABLE
from celery_keyed.ledger import HeldClaim, Outcome, Token
from celery_keyed.worker.failover import FailoverWatch
from celery_keyed.worker.fence import SelfFence
from celery_keyed.worker.running import Running

logger = logging.getLogger("celery_keyed")


class Heartbeat:
    """The heartbeat of one gate. ``heartbeat_once`` is one beat, in the caller's thread; ``start`` / ``stop``
    are safe to call twice."""

    def __init__(
        self,
        *,
        settings: Any,
        consumer: Any,
        ledger: Any,
        life: Any,
        lock: threading.Lock,
        running: dict[Token, Running],
        handoff: Any,
        releaser: Any,
        breaker: Any,
        revokes: Any,
        check_cancels: Callable[[], None] = lambda: None,
    ) -> None:
        self.settings = settings
        self.consumer = consumer  # set again by the gate at each consumer start
        self.ledger = ledger
        self.life = life  # the gate's lifecycle (worker/running.py): closed, stopping, started_at
        self.lock = lock
        self.running = running  # the running table (under ``lock``)
        self.handoff = handoff  # its ``prebound``, renewed like running claims
        self.releaser = releaser
        self.breaker = breaker
        self.revokes = revokes
        self.check_cancels = check_cancels  # newest wins (worker/cancels.py), set by the gate's wiring
        self.last_renewal = time.monotonic()
        self.pids: list[int] = []  # this process and its pool processes, as last recorded in the ledger
        self._exit = threading.Event()  # end the heartbeat now (tests, interpreter exit)
        self._thread: threading.Thread | None = None
        self.fence = SelfFence(
            lease=settings.lease,
            margin=settings.self_fence_margin,
            interval=settings.heartbeat_interval,
            running=self._running,
            terminate=self._terminate,
        )
        self.failover = FailoverWatch(lambda: self.ledger, lambda: self.releaser, lease=settings.lease)  # D20

    def start(self) -> None:
        """Start the thread unless it runs (a consumer restart finds it running, D13); the self-fence with it."""
        if self._thread is None or not self._thread.is_alive():
            self.last_renewal = time.monotonic()
            self._exit.clear()
            self._thread = threading.Thread(target=self._run, name="keyed-heartbeat", daemon=True)
            self._thread.start()
        self.fence.start()

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread now, whatever it still tracks; the self-fence with it. (The heartbeat may be blocked on
        the ledger: the join is bounded.)"""
        self._exit.set()
        self.fence.stop(timeout)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout)

    def _run(self) -> None:
        """D13: runs from the first consumer start until the worker has shut down and no claim it tracks is
        left (running attempts, promotions bound here, releases not yet committed)."""
        try:
            while not self._exit.wait(self.settings.heartbeat_interval):
                if self.life.closed and not (self.running or self.handoff.prebound or self.releaser.pending):
                    return
                try:
                    self.heartbeat_once()
                except Exception:  # it counts as a renewal that failed: the self-fence keeps the deadline
                    logger.exception("celery-keyed: heartbeat failed")
        finally:
            self.fence.stop(timeout=0)  # nothing left to renew, or stopped: nothing left to fence

    def heartbeat_once(self) -> None:
        """Renew the leases of the attempts this process runs and of the promotions bound to it that wait for
        a pool process; notice lost slots; self-fence when the ledger has been unreachable for too long; give
        back promotions that waited too long; retry releases that failed; probe the breaker."""
        settings, ledger, handoff = self.settings, self.ledger, self.handoff
        with self.lock:
            running = list(self.running.values())
            prebound = dict(handoff.prebound)
        held = {HeldClaim(r.token.task_id, r.token.attempt, r.fence): r for r in running}
        waiting = {HeldClaim(t.task_id, t.attempt, p.fence): (t, p) for t, p in prebound.items()}
        # D19: the lease a renewal sets is counted from its transaction's clock, which starts after this instant;
        # the time it returned would be later by however long the call took.
        sent = time.monotonic()
        try:
            if held or waiting:
                renewed = ledger.renew([*held, *waiting])
            else:  # nothing to renew: still find out whether the ledger is reachable (the breaker's probe)
                renewed = set()
                ledger.ping()
        except UNREACHABLE as exc:  # any other error goes up to _run's log; either way lease_from stays put
            self.breaker.open(exc)
            return
        self.last_renewal = sent
        for claim, r in held.items():
            if claim in renewed and sent > r.lease_from:
                r.lease_from = sent
        self.breaker.close()
        self.failover.after_renewal(held)  # D20: the server's identity; what each held claim holds
        pids = self.process_ids()
        if pids != self.pids:  # a pool process was replaced: a successor must know every pid to check (item 8)
            with contextlib.suppress(sa.exc.SQLAlchemyError):
                ledger.record_pids(pids)
                self.pids = pids
        missing = {c: r for c, r in held.items() if c not in renewed and r.request.keyed_claim is not None}
        lost = self.failover.take_back(missing, sent)  # D20: after a failover, claims lost with the old server
        for r in lost:  # reclaimed: our release would be fenced anyway; stop tracking it
            with self.lock:
                self.running.pop(r.token, None)
            r.request.keyed_claim = None
        for r in lost:
            if not r.fenced:
                self.fence.terminate(r, "its slot was reclaimed (lease expired)")
        # Newest wins: a newer arrival of an attempt's key and supersede key asked it to stop (the broadcast may have
        # been lost, or its claim was a promotion not yet bound here).
        with contextlib.suppress(sa.exc.SQLAlchemyError):
            self.check_cancels()
        with self.lock:
            for claim, (token, p) in waiting.items():
                if claim not in renewed and handoff.prebound.get(token) is p:
                    del handoff.prebound[token]  # lapsed: its request, if it starts, is admitted as usual (D14)
        # A promotion bound here that no pool process took within a heartbeat: its line must not wait on this
        # worker's busy pool while others idle.
        now = time.monotonic()
        handoff.give_back_prebound(
            lambda p: now - p.since >= settings.heartbeat_interval, "no pool process took it", on_loop=False
        )
        self._release_never_started(running)
        self.releaser.flush_pending()
        self.revokes.flush_pending()

    def _release_never_started(self, running: list[Running]) -> None:
        """D6: a request admitted but dropped before a pool process accepted it (the consumer reset on a broker
        reconnect forgets reserved requests; the broker redelivers their messages) would otherwise keep its
        claim renewed for ever. Such claims are released as "worker lost" once they are older than half a
        lease and their request is neither started nor reserved any more."""
        # Only while the consumer runs, and a beat after it (re)started: its loop reads the pool's "accepted"
        # messages (``keyed_started``). Stopped — a broker reconnect, a warm shutdown — a job a pool process took
        # just before looks never started, and its body may run for as long as it likes: releasing its claim then
        # would let another worker start the key's next task beside it. At shutdown such claims go back once the
        # pool has stopped (``GateService.release_unstarted``, at Celery's ``worker_shutdown``).
        if self.life.closed or self.life.stopping.is_set():
            return
        if time.monotonic() - self.life.started_at < self.settings.heartbeat_interval:
            return
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
            with self.lock:
                self.running.pop(r.token, None)
            if claim is None:
                continue
            self.releaser.hand_over(
                claim[0],
                claim[1],
                Outcome.WORKER_LOST,
                key=request.keyed_arrival_key,
                name=request.name,
                contended=True,
                on_loop=False,
            )

    def _running(self) -> list[Running]:
        """The self-fence's view: the attempts this process runs (a snapshot under the gate's lock)."""
        with self.lock:
            return list(self.running.values())

    def _terminate(self, r: Running, why: str) -> bool:
        """D7, D19: an attempt that may have lost its slot must not go on running (the self-fence's thread, or the
        heartbeat's for a slot found reclaimed). On the prefork pool its pool process is killed
        (``keyed_self_fence``, on by default) and the attempt is admitted again (``fence.readmit_fenced``);
        elsewhere the bound is best-effort, and we say so. False: a pool process has not taken it yet (asked again
        at the fence's next look)."""
        if self.settings.self_fence and self.can_terminate():
            pid = getattr(r.request, "worker_pid", None)
            if not pid:
                return False
            r.fenced = True
            # Marked before the kill: its failure hook (the loop) sends it back to be admitted again (D19).
            r.request.keyed_fenced = why
            logger.error("celery-keyed: terminating %s[%s]: %s", r.request.name, r.token.task_id, why)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return True
        r.fenced = True
        logger.error(
            "celery-keyed: %s[%s] keeps running although %s; the bound is best-effort until it ends",
            r.request.name,
            r.token.task_id,
            why,
        )
        return True

    def process_ids(self) -> list[int]:
        """This process and the pool processes that may run its keyed bodies (prefork), sorted."""
        pids = {os.getpid()}
        pool = getattr(self.consumer, "pool", None)
        with contextlib.suppress(Exception):
            pids.update(int(p) for p in (pool.info or {}).get("processes") or ())  # type: ignore[union-attr]
        return sorted(pids)

    def can_terminate(self) -> bool:
        """Whether the pool can terminate a running task (prefork); else the bound is best-effort (D7) and newest
        wins asks the task to stop (``keyed_cancelled()``)."""
        pool = getattr(self.consumer, "pool", None)
        return pool is not None and type(pool).__module__.startswith("celery.concurrency.prefork")
