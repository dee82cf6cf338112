"""The prefetch window: the consumer's QoS opened by one while a finished task's ack waits for its release to commit
(``widen_prefetch``, D15), and widened beyond Celery's own width by the pool processes expected to start soon, so
that a request whose slot is claimed ahead is fetched before a process frees (``fit_prefetch``).

Collaborators, given by the gate: the consumer (its QoS), the settings, the lifecycle, the lock, the handoff (how
many processes start soon) and the breaker; ``receipts`` (the receipt service) is set by the gate's start.
State: ``_spare`` (the widening applied) and ``_spare_qos`` (the QoS it was applied to), under the lock; any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from celery_keyed.worker.running import FollowsLifecycle, Lifecycle


class Prefetch(FollowsLifecycle):
    """The prefetch window of one worker process."""

    def __init__(
        self, *, consumer: Any, settings: Any, life: Lifecycle, lock: threading.Lock, handoff: Any, breaker: Any
    ) -> None:
        self.consumer = consumer
        self.settings = settings
        self.life = life
        self.lock = lock
        self.handoff = handoff
        self.breaker = breaker
        self.receipts: Any = None  # the receipt service (worker/admission.py), set by the gate's start
        self._spare = 0
        self._spare_qos: Any = None

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
