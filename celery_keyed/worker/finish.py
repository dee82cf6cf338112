"""The end of an attempt here: its outcome hooks give its slot back (``release``, on the consumer loop or the exit
watch's thread), a claim whose request will not start here goes back as "worker lost" (``_give_back``), and at the
worker's stop the requests no pool process ever accepted give theirs back (``release_unstarted``). The ledger's
transaction itself is the releaser's (worker/releaser.py).

Collaborators, given by the gate: the running table and its lock, the handoff (how long runs take here), the
releaser, the exit watch (worker/exits.py) and ``fit_prefetch`` (the prefetch window, refitted as each run ends).
State: ``releasing`` (releases between leaving the running table and the releaser's hands; under the lock).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from celery_keyed import metrics
from celery_keyed.ledger import Outcome, Token
from celery_keyed.worker.running import Running

logger = logging.getLogger("celery_keyed")


class Finish:
    """The end of the attempts of one worker process."""

    def __init__(
        self,
        *,
        lock: threading.Lock,
        running: dict[Token, Running],
        handoff: Any,
        releaser: Any,
        exits: Any,
        fit_prefetch: Callable[[], None],
    ) -> None:
        self.lock = lock
        self.running = running
        self.handoff = handoff
        self.releaser = releaser
        self.exits = exits
        self.fit_prefetch = fit_prefetch
        self.releasing = 0

    def release(
        self, request: Any, outcome: Outcome, *, uncertain: bool = False, on_loop: bool = True, detail: str = ""
    ) -> None:
        """Give back the slot of ``request`` after ``outcome``; idempotent (the hooks may fire twice). Called only
        once its body has provably stopped (D17): the pool reported the job's result or the process's exit; a hard
        time limit's release waits for that exit (``ExitWatch``, worker/exits.py). ``uncertain``: a hard time limit
        or a lost worker ended it; an uncertain hold may keep its slots. ``on_loop=False``: the caller is not the
        consumer loop's thread (the exit watch). ``detail``: recorded with a final outcome.

        The loop only forgets the claim and hands the release to the releaser (worker/releaser.py), whose
        thread runs the ledger's transaction on a connection of its own. Its promotions to run here come back
        to the loop already bound to this worker (D4). Without a running releaser (not started, or stopped at
        shutdown) the release runs in the caller's thread."""
        ack = request.keyed_take_deferred_ack() if hasattr(request, "keyed_take_deferred_ack") else None
        claim = request.keyed_claim
        if claim is None:
            if ack is not None:
                ack()
            return
        request.keyed_claim = None
        token, fence = claim
        superseded_by = getattr(request, "keyed_cancelled", None)
        if superseded_by is not None:
            # Newest wins: the cancel a newer arrival asked for reached this attempt (its pool process was terminated,
            # or its keyed_cancelled() flag raised) before its outcome: it is recorded superseded however it ended.
            outcome, uncertain, detail = Outcome.SUPERSEDED, False, superseded_by
            metrics.newest_wins("superseded")
        with self.lock:
            entry = self.running.pop(token, None)
            self.releasing += 1
        if entry is not None:
            self.handoff.note_run(time.monotonic() - entry.claimed_at)
        try:
            key = getattr(request, "keyed_arrival_key", None)
            hold = getattr(request.task, "uncertain_hold", None) if uncertain else None
            self.releaser.hand_over(
                token,
                fence,
                outcome,
                key=key,
                name=request.name,
                contended=self.releaser.is_contended(key),
                uncertain=uncertain,
                hold=hold,
                after=ack,
                on_loop=on_loop,
                detail=detail,
            )
        finally:
            with self.lock:
                self.releasing -= 1
        if entry is not None:
            try:  # after the release is handed over: nothing here may keep a slot from going back
                self.fit_prefetch()
            except Exception:
                logger.exception("celery-keyed: could not fit the prefetch window")

    def _give_back(self, request: Any, outcome: Outcome) -> None:
        """Release the claim of a request that will not start here, its promotions published (nothing here
        starts them: the consumer is stopped)."""
        claim, request.keyed_claim = request.keyed_claim, None
        if claim is None:
            return
        with self.lock:
            self.running.pop(claim[0], None)
        self.releaser.hand_over(
            claim[0], claim[1], outcome, key=request.keyed_arrival_key, name=request.name, contended=True, on_loop=False
        )

    def release_unstarted(self, why: str) -> int:
        """The worker has stopped its pool (Celery's ``worker_shutdown``, sent after the warm shutdown's pool join): a
        request still in the running table that no pool process ever accepted will never start here. Its message went
        back to the broker unacked; its claim goes back now, as "worker lost" (its redelivery is admitted again, D8),
        instead of being held by a worker that is gone until its lease lapses (found under load: a claim taken ahead
        whose request was handed to the pool just before the warm shutdown, the job dropped unstarted). Returns how
        many; in the caller's thread (the releaser is stopped). First the releases held for a pool process's exit
        (a hard time limit) whose process is gone now, without waiting for the exit watch's next look."""
        self.exits.watch_once()
        with self.lock:
            unstarted = [r for r in self.running.values() if not getattr(r.request, "keyed_started", False)]
            for r in unstarted:
                self.running.pop(r.token, None)
        for r in unstarted:
            request = r.request
            claim, request.keyed_claim = request.keyed_claim, None
            if claim is None:
                continue
            logger.warning(
                "celery-keyed: %s[%s] never started: %s; releasing its slot", request.name, r.token.task_id, why
            )
            self.releaser.hand_over(
                claim[0], claim[1], Outcome.WORKER_LOST, key=request.keyed_arrival_key, name=request.name,
                contended=True, on_loop=False,
            )  # fmt: skip
        self.releaser.flush_pending()
        return len(unstarted)
