"""The circuit breaker (D9): after a failed ledger call the gate stops calling the database for keyed work,
holds the keyed requests it receives (unacked: they stay in the broker's hands), stops consuming the queues
that carry only keyed tasks (``keyed_queues``), probes, and reopens by itself when the ledger answers again.

Threads and fields:

- ``is_open``, ``reachable_since``: written by any thread that finds the ledger unreachable (``open``) or
  reachable (``close``: the heartbeat, the probe); read by every thread. Plain values (one store each).
- ``held``, ``_cancelled_queues``: the consumer loop's only (``hold`` from ``execute``, ``probe_once`` on a loop
  timer, ``sync_keyed_queues`` from the loop's wakeup). Kombu's channel and Celery's consumer are not thread-safe,
  so the queues are cancelled and added back on the loop: ``open`` / ``close`` only wake it.

No thread of its own: the probe runs on a loop timer (``keyed_probe_interval``), and the heartbeat's renewal is
a probe too.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from celery_keyed import metrics
from celery_keyed.engine import UNREACHABLE

logger = logging.getLogger("celery_keyed")



class Breaker:
    """The breaker of one gate. ``probe_once`` is what the loop's timer runs. Collaborators: the ledger (its
    ping), the settings (``keyed_queues``), the consumer (its queues, and where held requests go back) and the
    handoff (the loop's wakeup and drain); the gate sets ``consumer`` again at each consumer start."""

    def __init__(self, *, ledger: Any, settings: Any, consumer: Any, handoff: Any) -> None:
        self.ledger = ledger
        self.settings = settings
        self.consumer = consumer
        self.handoff = handoff
        self.is_open = False
        self.reachable_since = time.monotonic()
        self.held: deque[Any] = deque()  # requests waiting for the ledger to come back (loop thread)
        self._cancelled_queues: list[str] = []  # keyed-only queues not consumed while open (loop thread)

    def open(self, exc: BaseException) -> None:
        """Any thread: a ledger call failed as unreachable."""
        if not self.is_open:
            logger.error("celery-keyed: the ledger is unreachable (%s); keyed tasks wait until it is back", exc)
        self.is_open = True
        self.reachable_since = float("inf")
        self.handoff.wake_loop()  # the loop stops consuming the keyed-only queues

    def close(self) -> None:
        """Any thread: a ledger call succeeded."""
        if self.is_open:
            logger.warning("celery-keyed: the ledger is reachable again; keyed intake resumes")
            self.reachable_since = time.monotonic()
            self.is_open = False
            self.handoff.wake_loop()  # the loop consumes the keyed-only queues again

    def sync_keyed_queues(self) -> None:
        """Consumer loop: while the breaker is open, do not consume the queues that carry only keyed tasks
        (``keyed_queues``), so that their messages stay in the broker instead of piling up, unacked, in this
        worker (D9); consume them again once it closes. Without ``keyed_queues`` the worker holds at most its
        prefetch of keyed messages. Loop thread only: kombu's channel is not thread-safe."""
        consumer = self.consumer
        task_consumer = getattr(consumer, "task_consumer", None)
        queues = self.settings.queues
        if not queues or task_consumer is None:
            return
        if self.is_open:
            for name in queues:
                if name not in self._cancelled_queues and task_consumer.consuming_from(name):
                    consumer.cancel_task_queue(name)
                    self._cancelled_queues.append(name)
                    logger.warning(
                        "celery-keyed: stopped consuming keyed-only queue %r while the ledger is unreachable", name
                    )
            return
        while self._cancelled_queues:
            name = self._cancelled_queues.pop()
            consumer.add_task_queue(name)
            logger.warning("celery-keyed: consuming keyed-only queue %r again", name)

    def hold(self, request: Any) -> None:
        """Consumer loop: keep a keyed request in memory (unacked) while the ledger is down; it stays in the
        broker's hands."""
        metrics.admission("held")
        self.held.append(request)

    def probe_once(self) -> None:
        """Consumer loop timer: probe the ledger when the breaker is open; give held requests back to the pool
        once it is closed."""
        if self.is_open:
            try:
                self.ledger.ping()
            except UNREACHABLE:  # an InterfaceError or a pool checkout timeout is unreachable too
                self.sync_keyed_queues()
                return
            self.close()
        while self.held and not self.is_open:
            request = self.held.popleft()
            self.consumer.on_task_request(request)
        self.handoff.drain()  # also a backstop for a missed wakeup
