"""The releaser: slots given back off the consumer loop, in batches.

An outcome hook (on the consumer loop) forgets the claim and hands the release here (``hand_over``); the
releaser's thread gives back everything handed to it since its last look in one ``Ledger.release_many`` (a
batch of one: ``Ledger.release``), on a connection of its own (DESIGN §5: a release need not block the loop; a
late release only keeps the bound stricter for a moment). The promotions a release makes go to the handoff
(``Handoff.dispatch``): those bound to this worker come back to the loop through the loop-calls pipe. An
``acks_late`` task's broker ack waits here until its release has committed (D15) and then goes back to the loop
too. A release that cannot commit (the ledger unreachable, D9) is kept in ``pending`` and retried by the
heartbeat with its ack (``flush_pending``): a slot held longer is safe. Without a running releaser (not
started, or stopped) a release runs in the caller's thread.

Releases of keys without a line here (not contended) wait up to ``RELEASE_LINGER`` for others to share their round
trip (a slot held a moment longer only keeps the bound stricter); a release of a contended key, a full batch, a
stop, or an admission of a key whose release waits here (``settle``) ends the wait at once.

Threads and fields:

- ``_releases``: appended by any thread that releases (the loop's outcome hooks, the heartbeat, the admission
  thread's callers), popped by the releaser's thread; ``_accepting`` says whether the thread takes new ones;
  both under ``_lock``.
- ``pending``: appended by whichever thread's release failed, flushed by the heartbeat (a deque: thread-safe
  ends; only the heartbeat pops).
- ``_contended``: key -> when it last parked or promoted (monotonic); written by the loop (admission) and the
  releaser's thread, read by the loop (one item set or get each).
- ``_keys``: key -> how many releases of it that may linger (not contended) were handed to the thread and have not
  finished; ``_hurry``: an admission waits for one of them (``settle``); both under ``_lock``, whose condition
  ``_done`` is notified after every batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from celery_keyed import metrics
from celery_keyed.engine import UNREACHABLE
from celery_keyed.ledger import Outcome, ReleaseReport, ReleaseRequest, Token

logger = logging.getLogger("celery_keyed")

#: Most releases the releaser thread gives back in one ``Ledger.release_many``.
RELEASE_BATCH = 64

#: Most seconds the releaser thread waits for more releases to share one round trip while every release handed to
#: it is of a key without a line here. Measured on b (1,000 uncontended keys, 2 cores): 3 ms takes the releases per
#: call from 1.3 to about 3 (4.7 since the thread takes one batch per look) and the CPU per keyed task down by a
#: tenth; a slot held that much longer is invisible to a key that nobody waits for, and a key with a line never
#: waits. 8-10 ms measured no better.
RELEASE_LINGER = 0.003

#: Most seconds an admission waits for a lingering release of its key to commit (``Releaser.settle``).
SETTLE_WAIT = 0.1

#: Seconds after a key last parked or promoted an attempt during which its releases promote in the same
#: transaction (no window where the freed slot is visible to another worker's sweeper).
CONTENDED_FOR = 5.0


@dataclass
class Release:
    """A release handed to the releaser (everything read by the caller, on its thread)."""

    token: Token
    fence: int
    outcome: Outcome
    key: str | None
    name: str
    contended: bool
    local_queues: list[str] | None
    local_tasks: list[str] | None
    uncertain: bool
    hold: Any
    released_at: float
    after: Callable[[], None] | None = None  # the broker ack, deferred until the release commits (D15)
    detail: str = ""  # recorded with the task's final outcome (newest wins: who superseded it)


class Releaser:
    """The releaser of one gate. ``release_once`` gives back one batch of what was handed over, in the caller's
    thread (tests); ``start`` / ``stop`` are safe to call twice."""

    def __init__(
        self, *, ledger: Any, handoff: Any, breaker: Any, life: Any, batch: int = RELEASE_BATCH,
        linger: float = RELEASE_LINGER,
    ) -> None:  # fmt: skip
        self.ledger = ledger
        self.handoff = handoff  # where its promotions go, and the loop calls (deferred acks)
        self.breaker = breaker
        self.life = life  # the gate's lifecycle (worker/running.py): no local handoff once shutdown began
        self.batch = max(1, batch)
        self.linger = linger
        self.pending: deque[Release] = deque()  # failed releases, retried by the heartbeat
        self._contended: dict[str, float] = {}
        self._releases: deque[Release] = deque()
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._keys: dict[str, int] = {}
        self._hurry = False
        self._lingering = False  # the thread waits in ``_linger`` (under ``_lock``)
        self._accepting = False  # a releaser thread runs and takes new releases
        self._working = 0  # releases taken from ``_releases`` (or run in a caller's thread) not finished yet
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()  # the current thread's; a new one per start
        self._warm_wanted = threading.Event()  # keyed work was seen: each releaser thread warms its connection up
        #: Told of every release that committed (the failover watch's journal, D20); set by the gate.
        self.on_released: Callable[[Release], None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._accepting:
                return
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(self._stop,), name="keyed-releaser", daemon=True)
            self._accepting = True
        self._thread.start()

    def stop(self, *, join: bool = True) -> None:
        """Take no new releases (later ones run in the caller's thread); the thread gives back the ones already
        handed over, then ends. ``join=False``: do not wait for it (``join`` later)."""
        with self._lock:
            self._accepting = False
            self._stop.set()
        self._ready.set()
        if join:
            self.join()

    def join(self, timeout: float = 5.0) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout)

    # -- contention --------------------------------------------------------------------------------------

    def mark_contended(self, key: str | None) -> None:
        """The key has a line now (an arrival parked, a promotion bound)."""
        if key is not None:
            self._contended[key] = time.monotonic()

    def is_contended(self, key: str | None) -> bool:
        return key is not None and time.monotonic() - self._contended.get(key, -1e9) < CONTENDED_FOR

    # -- the hand-over -----------------------------------------------------------------------------------

    def hand_over(
        self,
        token: Token,
        fence: int,
        outcome: Outcome,
        *,
        key: str | None,
        name: str,
        contended: bool,
        uncertain: bool = False,
        hold: Any = None,
        after: Callable[[], None] | None = None,
        on_loop: bool = True,
        detail: str = "",
    ) -> None:
        """Give the release to the releaser thread, or run it here when none runs (``on_loop``: the caller is
        the consumer loop's thread, which may start a promotion itself). ``after``: the broker ack
        of an ``acks_late`` task, run once the release has committed (D15: a finished body's outcome is in the
        books before its message leaves the broker; a crash in between redelivers a copy the ledger drops)."""
        local_queues, local_tasks = self.handoff.local_handoff(key)
        job = Release(
            token=token,
            fence=fence,
            outcome=outcome,
            key=key,
            name=name,
            contended=contended,
            local_queues=local_queues,
            local_tasks=local_tasks,
            uncertain=uncertain,
            hold=hold,
            released_at=metrics.clock(),
            detail=detail,
            after=after,
        )
        with self._lock:
            if self._accepting:
                self._releases.append(job)
                if key is not None and not contended:  # it may linger (``settle``)
                    self._keys[key] = self._keys.get(key, 0) + 1
                # A lingering thread wakes only for a release that ends its wait (contended, a full batch): a
                # wakeup per release costs the loop's process a thread switch and the interpreter's lock
                if not self._lingering or contended or len(self._releases) >= self.batch:
                    self._ready.set()
                return
            self._working += 1
        try:
            local = on_loop and not self.life.closed
            if not local:  # nobody here can start a promotion bound to us: every promotion is published (D5)
                job.local_queues = job.local_tasks = None
            self._release_now(job, local=local)
        finally:
            with self._lock:
                self._working -= 1

    def queued(self) -> int:
        with self._lock:
            return len(self._releases)

    def idle(self) -> bool:
        """No release handed over is waiting or running (those that failed wait in ``pending``)."""
        with self._lock:
            return not self._releases and not self._working

    def release_once(self) -> int:
        """Give back one batch of the releases handed over (in order); the number it took."""
        with self._lock:
            jobs = [self._releases.popleft() for _ in range(min(self.batch, len(self._releases)))]
            self._working += len(jobs)
            if not self._releases:
                self._hurry = False
        if not jobs:
            return 0
        try:
            self._release_batch(jobs)
        except Exception:
            logger.exception("celery-keyed: a batch of %d releases failed", len(jobs))
        finally:
            with self._lock:
                self._working -= len(jobs)
                for job in jobs:
                    if job.key is not None and not job.contended and job.key in self._keys:
                        left = self._keys[job.key] - 1
                        if left > 0:
                            self._keys[job.key] = left
                        else:
                            del self._keys[job.key]
                self._done.notify_all()
        return len(jobs)

    def settle(self, keys: Any, timeout: float = SETTLE_WAIT) -> bool:
        """An admission's thread, before it claims: when a release of one of ``keys`` that may linger (its key had no
        line here) waits in the releaser, have it go now and wait (at most ``timeout``) until it has committed, so
        that the arrival finds the slot its own worker just freed instead of parking behind it. A release of a key
        with a line never lingers and is not waited for. Whether nothing of those keys is left."""
        with self._lock:
            if not self._keys or not any(key in self._keys for key in keys):
                return True
            self._hurry = True
            self._ready.set()
            deadline = time.monotonic() + timeout
            while any(key in self._keys for key in keys):
                left = deadline - time.monotonic()
                if left <= 0 or not self._accepting:
                    return False
                self._done.wait(left)
        return True

    def _linger(self, stop: threading.Event) -> None:
        """The releaser thread, before it takes a batch: wait up to ``linger`` for more releases to share its round
        trip while every release handed over is of a key without a line here, fewer than a batch are waiting, no
        admission waits for one of them (``settle``) and the releaser is not stopping."""
        if self.linger <= 0.0:
            return
        deadline = time.monotonic() + self.linger
        while True:
            with self._lock:
                jobs = self._releases
                if (
                    not jobs or self._hurry or stop.is_set() or len(jobs) >= self.batch
                    or any(job.contended for job in jobs)
                ):
                    return
                left = deadline - time.monotonic()
                if left <= 0.0:
                    return
                self._lingering = True
            try:
                self._ready.wait(left)
            finally:
                with self._lock:
                    self._lingering = False
            self._ready.clear()

    def _run(self, stop: threading.Event) -> None:
        """The releaser thread: runs the releases handed to it, in order; on stop, the ones already handed over
        (``stop`` closes the hand-over first, so none is left behind). It keeps one ledger connection between its
        calls (``Ledger.pinned``), warmed up once keyed work was seen (``request_warm``, ``Ledger.warm_up``)."""
        with self.ledger.pinned():
            self._serve(stop)

    def request_warm(self) -> None:
        """Any thread: keyed work is coming; the releaser thread (this one and every later one) warms its ledger
        connection up once, before its next release (at once if it is idle), so that the first release — a
        handoff — does not pay a fresh backend's first use."""
        if not self._warm_wanted.is_set():
            self._warm_wanted.set()
            self._ready.set()

    def _serve(self, stop: threading.Event) -> None:
        warmed = False
        if self._warm_wanted.is_set():  # a later thread (consumer restart): its own connection, warmed at once
            self._ready.set()
        while True:
            self._ready.wait()
            self._ready.clear()
            if not warmed and self._warm_wanted.is_set() and not stop.is_set():
                warmed = True  # before the next release: it waits for the warm-up once, instead of running cold
                try:
                    self.ledger.warm_up()
                except Exception:  # never the end of the thread
                    logger.debug("celery-keyed: the releaser could not warm up", exc_info=True)
            self._linger(stop)
            if stop.is_set():
                while self.release_once():
                    pass
                return
            # one batch per look: releases handed over while it runs wait for the next look, which lingers for
            # more of them
            if self.release_once() and self.queued():
                self._ready.set()

    # -- releases ----------------------------------------------------------------------------------------

    def _release_batch(self, jobs: list[Release]) -> None:
        """The releaser thread: the releases handed over since its last look, in one ``release_many`` (one round
        trip for releases without waiters; the freed rooms with waiters promoted together)."""
        if len(jobs) == 1:
            self._release_now(jobs[0], local=False)
            return
        requests = [
            ReleaseRequest(
                token=job.token,
                fence=job.fence,
                outcome=job.outcome,
                detail=job.detail,
                contended=job.contended,
                local_queues=None if job.local_queues is None else frozenset(job.local_queues),
                local_tasks=None if job.local_tasks is None else frozenset(job.local_tasks),
                uncertain=job.uncertain,
                hold=job.hold,
            )
            for job in jobs
        ]
        granted = time.monotonic()  # before the call: the promotions' leases begin after it (Handoff.take_fresh)
        try:
            reports = self.ledger.release_many(requests)
        except sa.exc.DBAPIError as exc:
            if isinstance(exc, UNREACHABLE):
                self.breaker.open(exc)
            else:
                logger.exception("celery-keyed: a batch of %d releases failed", len(jobs))
            self.pending.extend(jobs)  # retried by the heartbeat; a release may be repeated safely
            return
        for job, report in zip(jobs, reports, strict=True):
            self._released(job, report, local=False, granted=granted)

    def _release_now(self, job: Release, *, local: bool) -> None:
        granted = time.monotonic()  # before the call: the promotions' leases begin after it (Handoff.take_fresh)
        try:
            report = self.ledger.release(
                job.token,
                job.fence,
                job.outcome,
                detail=job.detail,
                contended=job.contended,
                local_queues=job.local_queues,
                local_tasks=job.local_tasks,
                uncertain=job.uncertain,
                hold=job.hold,
            )
        except sa.exc.DBAPIError as exc:
            if isinstance(exc, UNREACHABLE):
                self.breaker.open(exc)
            else:
                logger.exception("celery-keyed: release of %s attempt %d failed", job.token.task_id, job.token.attempt)
            # Kept and retried by the heartbeat: a slot held longer is safe (D9); the ack waits with it (D15).
            self.pending.append(job)
            return
        except Exception:
            logger.exception("celery-keyed: release of %s attempt %d failed", job.token.task_id, job.token.attempt)
            self._after_release(job, local=local)
            return
        self._released(job, report, local=local, granted=granted)

    def _released(self, job: Release, report: ReleaseReport, *, local: bool, granted: float | None = None) -> None:
        """A release has committed: its deferred ack, its promotions (``granted``: the monotonic time taken before
        the release call, for the promotions bound to this worker)."""
        self._after_release(job, local=local)
        if self.on_released is not None:
            self.on_released(job)  # D20: given again if a failover loses it
        if report.promotions:
            self.mark_contended(job.key)
        for task_id, final in report.finished:
            if final == "dead_lettered":
                logger.error("celery-keyed: group head %s[%s] dead-lettered (its group's failure policy decides what"
                             " follows: docs/groups.md)", job.name, task_id)
        metrics.promoted(report.promotions, job.released_at)
        self.handoff.dispatch(report.promotions, local=local, granted=granted)

    def _after_release(self, job: Release, *, local: bool) -> None:
        """Run the release's deferred ack: here when on the loop thread, else on the loop (kombu's channel is
        not thread-safe)."""
        if job.after is None:
            return
        after, job.after = job.after, None
        if local:
            after()
        else:
            self.handoff.call_on_loop(after)

    def flush_pending(self) -> None:
        """Heartbeat thread: retry the releases that failed while the ledger was unreachable, in order; stop at
        the first that still fails."""
        while self.pending:
            job = self.pending[0]
            try:
                report = self.ledger.release(job.token, job.fence, job.outcome)
            except sa.exc.DBAPIError as exc:
                logger.info(
                    "celery-keyed: release of %s attempt %d still pending (%s)",
                    job.token.task_id,
                    job.token.attempt,
                    type(exc).__name__,
                )
                return
            self.pending.popleft()
            logger.info(
                "celery-keyed: pending release of %s attempt %d done (%s); %d promoted",
                job.token.task_id,
                job.token.attempt,
                "released" if report.released else "already released",
                len(report.promotions),
            )
            self._after_release(job, local=False)
            self.handoff.dispatch(report.promotions, local=False)
