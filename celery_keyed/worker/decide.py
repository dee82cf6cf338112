"""The off-loop decisions: what the admission and receipt services' threads (worker/admission.py) decide for a
batch of requests. Promotions (bound here earlier, or carrying a nonce) are bound one by one (a guarded statement
each, D14); ordinary arrivals in one ``admit_many``; arrivals handed over at receipt are parked, or their slots
claimed ahead. A claim is tracked in the running table (renewed by the heartbeat) the moment it is taken.

Collaborators, given by the gate: the ledger, the lifecycle, the running table and its lock, the handoff (the claims
bound here) and the releaser (a claim decided after the consumer stopped is given back). No state of its own: it
runs in the calling service's thread.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from celery_keyed.engine import UNREACHABLE
from celery_keyed.headers import HEADER_NONCE
from celery_keyed.ledger import Admission, Arrival, Outcome, Token, Verdict
from celery_keyed.worker.running import FollowsLifecycle, Job, Lifecycle, Prebound, Running, track

logger = logging.getLogger("celery_keyed")


def _keys_of(jobs: Sequence[Job]) -> set[str]:
    """Every concurrency key of the arrivals of a batch."""
    return {key for job in jobs if job.arrival is not None for key in job.arrival.keys}


class Decide(FollowsLifecycle):
    """The decisions of the admission and receipt threads. ``_decide`` is what those services run per batch."""

    def __init__(
        self,
        *,
        ledger: Any,
        life: Lifecycle,
        lock: threading.Lock,
        running: dict[Token, Running],
        handoff: Any,
        releaser: Any,
        remember: Callable[[Any, Any], None] | None = None,
    ) -> None:
        self.ledger = ledger
        self.life = life
        self.lock = lock
        self.running = running
        self.handoff = handoff
        self.releaser = releaser
        self.remember = remember  # the failover watch's memory of what a claim holds (D20)

    def _decide(self, jobs: Sequence[Job]) -> None:
        """The admission thread: decide a batch. Promotions (bound earlier, or carrying a nonce) are bound one by
        one (a guarded statement each, D14); the ordinary arrivals in one ``admit_many``, in the order they
        reached the pool. A claim is tracked (renewed by the heartbeat) from the moment it is taken. Arrivals
        handed over at receipt (``receive``) are parked or left alone (``Ledger.park_at_receipt``)."""
        plain: list[Job] = []
        # a release of one of these keys that waits in the releaser (it may linger) commits first: the arrival
        # finds the slot its own worker freed instead of parking behind it
        self.releaser.settle(_keys_of(jobs))
        sent = time.monotonic()  # before any call of this batch: a lower bound of every claim's lease start
        self._decide_received([job for job in jobs if job.extra.get("receipt")])
        for job in jobs:
            if job.extra.get("receipt"):
                continue
            try:
                fence = self.handoff.confirm_prebound(job.arrival.token)
                if fence is None:
                    fence = self._bind_promoted(job.request, job.arrival)
            except Exception as exc:
                job.error = exc
                continue
            if fence is not None:
                job.result = (fence, None)
                track(
                    self.lock, self.running, job.request, job.arrival.token, fence, since=sent,
                    remember=self.remember, arrival=job.arrival,
                )  # fmt: skip
            else:
                plain.append(job)
        if not plain:
            return
        admissions: list[Admission | None]
        try:
            admissions = list(self._admit_many([job.arrival for job in plain]))
        except UNREACHABLE as exc:
            for job in plain:
                job.error = exc
            return
        except Exception:  # one message's data refused: decide them one by one, so that only it is refused
            admissions = []
            for job in plain:
                try:
                    admissions.append(self.ledger.admit(job.arrival))
                except Exception as exc:
                    admissions.append(None)
                    job.error = exc
        for job, admission in zip(plain, admissions, strict=True):
            if admission is None:
                continue
            job.result = (None, admission)
            if admission.verdict is Verdict.ADMITTED and admission.fence is not None:
                track(
                    self.lock, self.running, job.request, job.arrival.token, admission.fence, since=sent,
                    remember=self.remember, arrival=job.arrival,
                )  # fmt: skip

    def _decide_received(self, jobs: list[Job]) -> None:
        """The receipt service's thread: the jobs handed over at receipt, in the order they were received: runs of
        parks (``_park_received``) and of claims ahead (``_claim_ahead``); requests handed on in order
        (``_pass_job``) need no ledger call."""
        run: list[Job] = []
        for job in [*jobs, None]:
            ahead = job is not None and bool(job.extra.get("ahead"))
            if job is not None and job.extra.get("pass"):
                continue
            if run and (job is None or ahead != bool(run[0].extra.get("ahead"))):
                if run[0].extra.get("ahead"):
                    self._claim_ahead(run)
                else:
                    self._park_received(run)
                run = []
            if job is not None:
                run.append(job)

    def _claim_ahead(self, jobs: list[Job]) -> None:
        """The receipt service's thread: admit the arrivals whose slots are claimed ahead (``_ahead_job``) in one
        ``admit_many``; each claim goes to ``Handoff.prebound`` at once (renewed by the heartbeat from now on, given
        back at shutdown), with the monotonic time taken before the call (``Prebound.granted``: its lease holds until
        ``granted + lease - self_fence_margin``)."""
        granted = time.monotonic()
        try:
            admissions = self._admit_many([job.arrival for job in jobs])
        except Exception as exc:  # unreachable (D9) or a bug: each is admitted as usual when a pool process is ready
            for job in jobs:
                job.error = exc
            return
        late: list[tuple[Arrival, int]] = []
        for job, admission in zip(jobs, admissions, strict=True):
            job.result = (None, admission)
            if admission.verdict is Verdict.ADMITTED and admission.fence is not None:
                # Under the lock that shutdown's give-back takes: a claim decided after the consumer stopped (its
                # thread outlived the stop's wait, under load) is given back here, never left for nobody to renew.
                with self.lock:
                    stale = self.closed or self.stopping.is_set() or job.extra.get("generation") != self.generation
                    if not stale:
                        self.handoff.prebound[job.arrival.token] = Prebound(
                            admission.fence, job.arrival.key, granted=granted, ahead=True
                        )
                if stale:
                    late.append((job.arrival, admission.fence))
        for arrival, fence in late:
            self.releaser.hand_over(
                arrival.token, fence, Outcome.WORKER_LOST, key=arrival.key, name="", contended=False, on_loop=False
            )

    def _park_received(self, jobs: list[Job]) -> None:
        """The receipt service's thread: park the arrivals handed over at receipt, in one round trip for a batch
        (``Ledger.park_many_at_receipt``: one transaction each, in the order they were received)."""
        if not jobs:
            return
        park_many = getattr(self.ledger, "park_many_at_receipt", None)
        if park_many is None or len(jobs) == 1:
            for job in jobs:
                try:
                    job.result = (None, self.ledger.park_at_receipt(job.arrival))
                except Exception as exc:
                    job.error = exc
            return
        try:
            answers = park_many([job.arrival for job in jobs])
        except Exception as exc:
            for job in jobs:
                job.error = exc
            return
        for job, answer in zip(jobs, answers, strict=True):
            if isinstance(answer, BaseException):
                job.error = answer
            else:
                job.result = (None, answer)

    def _admit_many(self, arrivals: list[Arrival]) -> list[Admission]:
        admit_many = getattr(self.ledger, "admit_many", None)
        if admit_many is not None and len(arrivals) > 1:
            return list(admit_many(arrivals))
        return [self.ledger.admit(arrival) for arrival in arrivals]

    def _bind_promoted(self, request: Any, arrival: Arrival) -> int | None:
        nonce = request._request_dict.get(HEADER_NONCE)
        if not nonce:
            return None
        try:
            parsed = uuid.UUID(str(nonce))
        except ValueError:
            logger.warning(
                "celery-keyed: task %s carries a malformed admission token; admitting it as usual", request.id
            )
            return None
        return self.ledger.bind(arrival.token, parsed)  # None: not a live promotion → ordinary admission
