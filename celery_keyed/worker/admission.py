"""The admission service: keyed requests are admitted off the consumer loop, in batches.

The consumer loop calls ``GateService.execute`` when a pool process is free for a request (D3: Celery's pool
semaphore is taken for it). Instead of waiting there on PostgreSQL, the gate hands the request to this service
and returns; the semaphore stays taken, so the pool process stays reserved for the request while its admission
is decided. The service's thread takes every request handed to it so far (up to ``keyed_admission_batch``),
decides them with as few ledger calls as it can (``Ledger.admit_many`` for ordinary arrivals; a guarded
statement each for promotions bound earlier, D14), and hands the verdicts back to the loop, which starts the
admitted ones in their pool process and acks, parks or drops the others (kombu's channel and Celery's pool
belong to the loop thread).

Order: requests are decided in the order the loop handed them over (one thread, one queue, ``admit_many``
keeps the order of its input), so two arrivals of one key are decided in the order they reached the pool.

Thread ownership: ``_jobs`` is shared (appends from the loop, pops on the service's thread, under ``_lock``);
everything a ``Job`` carries is read on the loop before the hand-over or written once by the thread before the
verdict goes back to the loop.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from celery_keyed.worker.running import Job

logger = logging.getLogger("celery_keyed")

#: A thread waits for more jobs that may wait (``Job.extra["by"]``) only while fewer than this many are queued.
LINGER_BATCH = 16


class AdmissionService:
    """A thread that decides batches of ``Job`` with ``decide(jobs)`` and hands each decided batch to
    ``deliver(jobs)`` (which runs the loop's part, on the loop). ``start`` / ``stop`` are safe to call twice;
    ``admit_once`` decides what is queued now, in the caller's thread (tests)."""

    def __init__(
        self,
        decide: Callable[[Sequence[Job]], None],
        deliver: Callable[[list[Job]], None],
        *,
        batch: int,
        name: str = "keyed-admission",
        thread_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        warm: Callable[[], Any] | None = None,
    ) -> None:
        self._name = name
        #: Entered by the service's thread for its lifetime (the ledger's ``pinned``: one connection kept).
        self._thread_context = thread_context
        #: Run once by each of the service's threads, inside its context, once ``request_warm`` was called
        #: (the ledger's ``warm_up``).
        self._warm = warm
        self._warm_wanted = threading.Event()
        self._decide = decide
        self._deliver = deliver
        self._batch = max(1, batch)
        self._lock = threading.Lock()
        self._jobs: deque[Job] = deque()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._accepting = False
        #: Until when (monotonic) the thread waits for more arrivals to share its batch (``lingering``); None while
        #: it waits for work or decides. Under ``_lock``: a submit that cannot end that wait does not wake it.
        self._linger_until: float | None = None

    @property
    def accepting(self) -> bool:
        return self._accepting

    def start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._accepting = True
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._accepting = True
        self._thread.start()

    def submit(self, job: Job) -> bool:
        """Loop thread: queue ``job``; False when the service takes no new work (stopped)."""
        with self._lock:
            if not self._accepting:
                return False
            self._jobs.append(job)
            until, by = self._linger_until, job.extra.get("by")
            # While the thread lingers, a job that would not end its wait leaves it asleep (a wakeup per arrival
            # costs the loop's process a thread switch and the interpreter's lock, for nothing decided)
            wake = until is None or by is None or by < until or len(self._jobs) >= LINGER_BATCH
        if wake:
            self._ready.set()
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Take no new work, decide and deliver what was handed over, end the thread."""
        with self._lock:
            self._accepting = False
            thread = self._thread
        self._stop.set()
        self._ready.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout)
        with self._lock:
            if self._thread is thread and (thread is None or not thread.is_alive()):
                self._thread = None
        self.admit_once()  # anything queued after the thread's last look (none when it ended normally)

    def request_warm(self) -> None:
        """Any thread: keyed work is coming; the service's thread (this one and every later one) runs ``warm``
        once, before its next batch (at once if it is idle)."""
        if self._warm is not None and not self._warm_wanted.is_set():
            self._warm_wanted.set()
            self._ready.set()

    def pending(self) -> int:
        with self._lock:
            return len(self._jobs)

    def admit_once(self) -> int:
        """Decide and deliver one batch of what is queued now; the number of jobs it took."""
        with self._lock:
            jobs = [self._jobs.popleft() for _ in range(min(self._batch, len(self._jobs)))]
        if not jobs:
            return 0
        try:
            self._decide(jobs)
        except BaseException as exc:  # decide reports per job; this is a bug: every job of the batch fails
            logger.exception("celery-keyed: admission of a batch of %d failed", len(jobs))
            for job in jobs:
                if job.result is None and job.error is None:
                    job.error = exc
        self._deliver(jobs)
        return len(jobs)

    def _run(self) -> None:
        with self._thread_context():
            self._serve()

    def lingering(self, now: float | None = None) -> float:
        """Seconds the service's thread may still wait before deciding what is queued: while every queued job may
        wait (``Job.extra["by"]``: a monotonic time, set for claims taken ahead of a pool process) and fewer than
        ``LINGER_BATCH`` are queued, until the earliest of their times; else 0.0 (decide now)."""
        moment = time.monotonic() if now is None else now
        with self._lock:
            if not self._jobs or len(self._jobs) >= LINGER_BATCH:
                return 0.0
            earliest = None
            for job in self._jobs:
                by = job.extra.get("by")
                if by is None:
                    return 0.0
                earliest = by if earliest is None else min(earliest, by)
        return 0.0 if earliest is None else max(0.0, earliest - moment)

    def _serve(self) -> None:
        warmed = False
        if self._warm_wanted.is_set():  # a later thread (consumer restart): its own connection, warmed at once
            self._ready.set()
        timeout: float | None = None
        while True:
            self._ready.wait(timeout)
            with self._lock:
                self._linger_until = None
            self._ready.clear()
            timeout = None
            if not self._stop.is_set():
                moment = time.monotonic()
                delay = self.lingering(moment)
                if delay > 0.0:  # more arrivals may join this batch: one round trip for all of them
                    timeout = delay
                    with self._lock:
                        self._linger_until = moment + delay
                    continue
            if not warmed and self._warm is not None and self._warm_wanted.is_set() and not self._stop.is_set():
                # before the next batch: its first request waits for the warm-up once, where it would otherwise
                # pay the cold connection's first use itself
                warmed = True
                try:
                    self._warm()
                except Exception:  # a warm-up is an optimisation: never the end of the thread
                    logger.debug("celery-keyed: %s could not warm up", self._name, exc_info=True)
            if self._stop.is_set():
                while self.admit_once():
                    pass
                return
            # one batch per look: what arrives while it is decided waits for the next look, which lingers for
            # more of it (a loop here decided those in batches of one or two)
            if self.admit_once() and self.pending():
                self._ready.set()
