"""The sweeper: time-triggered work (D2), the reaper (D7), gone predecessors, and the results of tasks that
never ran (D11).

Every ``keyed_sweep_interval`` its thread runs ``sweep_once``: the ledger's due-time sweep (not-before times,
retry backoff, rate tokens, expiries, lost group numbers, stale reserves), whose promotions go to the handoff;
every quarter lease the claims of earlier worker starts on this machine whose processes are all gone; every
quarter lease also the reaper — but only once this process has reached the ledger for a full lease
(``Breaker.reachable_since``): a worker that was cut off cannot tell a dead peer from a peer that was cut off
too. Then ``notify_never_ran`` stores a failure result for every task that got a final outcome without running;
last, the outbox relay publishes what is due (``publisher.relay_outbox``).

Threads and fields: the sweeper's thread belongs to the consumer (started and stopped with it; skips its turn
while the breaker is open). ``_last_reclaim`` and ``_last_gone_check`` are its thread's only (``sweep_once``
called by a test runs in the test's thread, with the thread not started). ``notify_never_ran`` and
``store_never_ran`` also run on the loop (after a revoke, a supersede: for those task ids, waiting for another
worker storing one of them) and on the heartbeat (pending revokes): they keep no state; the ledger's row locks keep
two of them from storing one result (``Ledger.take_never_ran``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from celery_keyed import exceptions
from celery_keyed.messages import context_from_record
from celery_keyed.publisher import arrival_timeout, relay_outbox

logger = logging.getLogger("celery_keyed")


class Sweeper:
    """The sweeper of one gate. ``sweep_once`` is one turn, in the caller's thread; ``start`` / ``stop`` are
    safe to call twice."""

    def __init__(
        self,
        *,
        app: Any,
        settings: Any,
        ledger: Any,
        breaker: Any,
        handoff: Any,
        announce_never_ran: Callable[..., None],
    ) -> None:
        self.app = app
        self.settings = settings
        self.ledger = ledger
        self.breaker = breaker
        self.handoff = handoff  # the dispatch of the promotions it finds
        self.announce_never_ran = announce_never_ran
        self._last_reclaim = 0.0
        self._last_gone_check = time.monotonic()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()  # the current thread's; a new one per start

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive() and not self._stop.is_set():
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._stop,), name="keyed-sweeper", daemon=True)
        self._thread.start()

    def stop(self, *, join: bool = True) -> None:
        self._stop.set()
        if join:
            self.join()

    def join(self, timeout: float = 5.0) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout)

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self.settings.sweep_interval):
            if self.breaker.is_open:
                continue
            try:
                self.sweep_once()
            except sa.exc.OperationalError as exc:
                self.breaker.open(exc)
            except Exception:
                logger.exception("celery-keyed: sweep failed")

    def sweep_once(self) -> None:
        """Time-triggered work (D2); every quarter lease also the reaper (D7), but only once this process has
        reached the ledger for a full lease: a worker that was cut off cannot tell a dead peer from a peer
        that was cut off too."""
        settings, ledger, handoff = self.settings, self.ledger, self.handoff
        report = ledger.sweep(
            group_arrival_timeout=settings.group_arrival_timeout, reserve_timeout=settings.reserve_timeout
        )
        handoff.dispatch(report.promotions, local=False)
        now = time.monotonic()
        if now - self._last_gone_check >= settings.lease / 4:
            # Workers of this machine known dead (every process gone): no need to wait for their leases.
            self._last_gone_check = now
            handoff.dispatch(ledger.reclaim_gone_predecessors().promotions, local=False)
        reachable_since = self.breaker.reachable_since
        if now - reachable_since >= settings.lease and now - self._last_reclaim >= settings.lease / 4:
            self._last_reclaim = now
            reclaimed = ledger.reclaim()
            for token in reclaimed.reclaimed:
                logger.warning(
                    "celery-keyed: reclaimed the slot of %s attempt %d (its lease expired)",
                    token.task_id,
                    token.attempt,
                )
            handoff.dispatch(reclaimed.promotions, local=False)
        self.notify_never_ran()
        # The outbox: registrations committed in a caller's transaction, and messages no worker
        # received within the arrival timeout, are published from their stored copy.
        relay_outbox(
            self.app,
            ledger,
            arrival_timeout=arrival_timeout(settings, grouped=False),
            grouped_timeout=arrival_timeout(settings, grouped=True),
        )

    def notify_never_ran(self, task_ids: list[str] | None = None) -> None:
        """Store a failure result for every task that got a final outcome without running (D11): ``task_ids``, or
        the oldest the books list. Each row is held while its result is stored (``Ledger.take_never_ran``), so a
        result is stored once however many notifiers run. A store that failed (the backend out of reach, most
        likely) ends the turn: that row and the rest wait for the next sweep."""
        with self.ledger.take_never_ran(task_ids) as taken:
            for row in taken.rows:
                if not self.store_never_ran(row.task_id, row.outcome, row.detail, row.message, task_name=row.task_name):
                    break
                taken.stored(row.task_id)

    def store_never_ran(
        self, task_id: str, outcome: str, detail: str, record: dict[str, Any] | None, task_name: str = ""
    ) -> bool:
        """Store the failure result of a task that will never run (``KeyedRejected``, ``KeyedExpired``…, D11)
        through its task's result backend, and announce it. True when stored. A stored message the backend cannot
        take as a request (a hostile producer's) is stored without its context rather than retried for ever."""
        app = self.app
        exc = exceptions.BY_OUTCOME.get(outcome, exceptions.KeyedOutcome)(detail)
        bare = {"id": task_id, "task": task_name}
        context = context_from_record(record) if record else bare
        name = str(context.get("task") or task_name)
        from celery.app.task import Context

        task = app.tasks.get(name)
        backend = task.backend if task is not None else app.backend
        for attempt in (context, bare) if context is not bare else (bare,):
            try:
                backend.mark_as_failure(task_id, exc, request=Context(attempt), store_result=True)
            except Exception:
                logger.exception("celery-keyed: could not store the %s outcome of %s", outcome, task_id)
                continue
            self.announce_never_ran(task_id, outcome, detail, name, None)
            return True
        return False
