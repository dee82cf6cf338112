"""Newest wins (``on_newer="cancel_running"``): an admission asked older attempts of its supersede key to stop. Those
this process runs are cancelled here — on prefork their pool process is terminated (on the consumer loop), else
``keyed_cancelled()`` turns true — and the other holders are told by the ``keyed_cancel`` broadcast; each holder's
heartbeat also asks the ledger (``check_cancels``), so a lost broadcast only delays it.

Collaborators, given by the gate: the app (its control broadcast), the consumer (its pool), the ledger, the running
table and its lock, the handoff (calls on the loop) and ``can_terminate`` (whether the pool's processes can be
terminated: the heartbeat's answer). State: ``pid`` (the worker's main process: a pool process forked later holds a
stale copy); ``Running.cancelled`` of the running entries (under the lock).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable
from signal import SIGTERM
from typing import Any

from celery_keyed import metrics
from celery_keyed.headers import HEADER_ON_NEWER, HEADER_SUPERSEDE
from celery_keyed.ledger import HeldClaim, Token
from celery_keyed.worker.running import Running

logger = logging.getLogger("celery_keyed")


def _cancellable(request: Any) -> bool:
    """Whether a newer arrival can ask this attempt to stop (newest wins): its claim carries a supersede key only when
    it was sent with ``on_newer`` or with a supersede key. The heartbeat asks the ledger about those only."""
    headers = getattr(request, "_request_dict", None) or {}
    if headers.get(HEADER_ON_NEWER) is not None or headers.get(HEADER_SUPERSEDE) is not None:
        return True
    task = getattr(request, "task", None)
    return getattr(task, "on_newer", None) is not None or getattr(task, "supersede_key", None) is not None


class Cancels:
    """The newest-wins cancels of one worker process."""

    def __init__(
        self,
        *,
        app: Any,
        consumer: Any,
        ledger: Any,
        lock: threading.Lock,
        running: dict[Token, Running],
        handoff: Any,
        can_terminate: Callable[[], bool],
    ) -> None:
        self.app = app
        self.consumer = consumer
        self.ledger = ledger
        self.lock = lock
        self.running = running
        self.handoff = handoff
        self.can_terminate = can_terminate
        self.pid = os.getpid()  # the worker's main process (pool processes forked later inherit a copy)

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
        prefork = self.can_terminate()
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
