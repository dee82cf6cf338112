"""A measurement of a design, not a feature: the worker's releases made from the consumer loop without blocking it.

``python -m bench.gate --only b --loop-releases`` runs gate b a third way (variant "keyed-loop-releases"): a keyed
worker whose outcome hooks, instead of handing each release to the releaser's thread, queue it on the loop; the loop
sends the queued releases in one ``keyed_release_and_promote`` call on a connection of its own, as a non-blocking
libpq query (``psycopg.pq``), and reads its rows when the hub says the connection's socket is readable, with one call
in flight at a time (what arrives meanwhile goes in the next call, as the releaser thread batches). Releases of keys
without a line wait up to the releaser's ``RELEASE_LINGER`` for company, as the thread's do.

Only what gate b needs is done here: uncontended releases of one key, no group, no uncertain end. Anything else
(a contended key, a heartbeat's release, a shutdown's) goes to the releaser's thread as before; a release the call
did not finish (a stale fence, a shadow to follow, a line whose head is not plain) or any promotion it made is
counted and reported at the worker's exit (``loop-releases:`` in its log), so a run that needed more is seen; a call
that failed puts its releases in the releaser's ``pending`` (the heartbeat retries them). Shutdown, the breaker,
failover and the local handoff of promotions are not handled: it is not for use beside real work.
"""

from __future__ import annotations

import atexit
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from psycopg import pq
from psycopg.adapt import Transformer

from celery_keyed import metrics
from celery_keyed.ledger import Promotion, ReleaseReport, Token, driver, fast_paths
from celery_keyed.ledger.outcomes import final_outcome
from celery_keyed.worker.releaser import RELEASE_BATCH, RELEASE_LINGER, Release, Releaser

logger = logging.getLogger("celery_keyed")


def positional(text: str) -> tuple[bytes, list[str]]:
    """A driver statement's ``%(name)s`` placeholders as libpq's ``$n`` (one per distinct name), and the names in
    their order."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return re.sub(r"%\((\w+)\)s", number, text).replace("%%", "%").encode(), names


SQL, NAMES = positional(driver.driver_sql(fast_paths.RELEASE_AND_PROMOTE))
COUNTS = {"calls": 0, "released": 0, "not_finished": 0, "promotions": 0, "to_thread": 0, "failed": 0}


def as_text(value: Any) -> bytes | None:
    """A parameter in libpq's text format (lists as array literals, as ``driver.run`` sends them)."""
    if value is None:
        return None
    if type(value) is list:
        literal = driver.array_literal(value)
        assert literal is not None, value
        return literal.encode()
    return str(value).encode()


class LoopReleases:
    """The loop's releases of one releaser: ``add`` queues one (loop thread); the hub runs ``_send`` and
    ``_readable``."""

    def __init__(self, releaser: Releaser, hub: Any) -> None:
        self.releaser = releaser
        self.hub = hub
        self.sa_conn = releaser.ledger.autocommit.connect()  # the ledger's own set-up (timeouts, identity watch)
        self.conn = self.sa_conn.connection.driver_connection
        self.pgconn = self.conn.pgconn
        self.pgconn.nonblocking = 1
        self.socket = self.pgconn.socket
        self.transformer = Transformer(self.conn)
        self.queue: list[Release] = []
        self.oldest = 0.0  # monotonic time the oldest queued release was queued
        self.in_flight: list[Release] | None = None
        self.results: list[pq.abc.PGresult] = []
        self.scheduled = False
        self.sent_at = 0.0

    def add(self, job: Release) -> None:
        if not self.queue:
            self.oldest = time.monotonic()
        self.queue.append(job)
        if self.in_flight is None:
            self._send_or_wait()

    def _send_or_wait(self) -> None:
        """No call in flight: send the queue once it is a batch or its oldest release has waited ``RELEASE_LINGER``
        for company (counted from when it was queued, so a release queued during a call waits no longer for it)."""
        left = self.oldest + RELEASE_LINGER - time.monotonic()
        if len(self.queue) >= RELEASE_BATCH or left <= 0.0:
            self._send()
        elif not self.scheduled:
            self.scheduled = True
            self.hub.call_later(left, self._kick)

    def _kick(self) -> None:
        self.scheduled = False
        if self.in_flight is None and self.queue:
            self._send_or_wait()

    def _send(self) -> None:
        jobs, self.queue = self.queue[:RELEASE_BATCH], self.queue[RELEASE_BATCH:]
        self.oldest = time.monotonic()  # those left (a batch's overflow) are sent when this call ends
        params: dict[str, Any] = {
            "task_ids": [job.token.task_id for job in jobs],
            "attempts": [job.token.attempt for job in jobs],
            "fences": [job.fence for job in jobs],
            "finals": [getattr(final_outcome(job.outcome, grouped=False), "value", None) for job in jobs],
            "details": [job.detail for job in jobs],
            "now": None,
            "dispatch": self.releaser.ledger.dispatch,
            "local_holder": None,
            "local_lease": self.releaser.ledger.lease,
            "local_sets": "[]",
            "local_set": [None for _ in jobs],
        }
        self.sent_at = time.monotonic()
        self.pgconn.send_query_params(SQL, [as_text(params[name]) for name in NAMES])
        while self.pgconn.flush():
            pass
        self.in_flight, self.results = jobs, []
        self.hub.add_reader(self.socket, self._readable)
        COUNTS["calls"] += 1

    def _readable(self, *args: Any) -> None:
        self.pgconn.consume_input()
        while not self.pgconn.is_busy():
            result = self.pgconn.get_result()
            if result is None:
                break
            self.results.append(result)
        else:
            return  # more of the answer to come
        self.hub.remove_reader(self.socket)
        jobs, self.in_flight = self.in_flight or [], None
        answer = self.results[-1] if self.results else None
        if answer is None or answer.status != pq.ExecStatus.TUPLES_OK:
            COUNTS["failed"] += len(jobs)
            logger.warning("loop-releases: a call failed: %s", answer.error_message if answer else "no answer")
            self.releaser.pending.extend(jobs)  # the heartbeat retries them
        else:
            self._settle(jobs, answer)
        if self.queue:
            self._send_or_wait()

    def _settle(self, jobs: list[Release], answer: pq.abc.PGresult) -> None:
        self.transformer.set_pgresult(answer)
        rows = self.transformer.load_rows(0, answer.ntuples, tuple)
        released: dict[int, tuple[Any, ...]] = {}
        promotions: list[Promotion] = []
        for row in rows:
            if row[0] == "release":
                released[row[1]] = row
                COUNTS["not_finished"] += bool(row[4])  # a shadow to follow (D8)
            elif row[0] == "promotion":
                promotions.append(Promotion(
                    task_id=row[8], attempt=row[9], nonce=row[10], fence=row[11], key=row[5], group_key=None,
                    queue=row[13], message=row[14],
                ))
            else:
                COUNTS["not_finished"] += 1  # a line whose head is not plain
        COUNTS["promotions"] += len(promotions)
        for ordinal, job in enumerate(jobs, 1):
            answer_row = released.get(ordinal)
            done = bool(answer_row and answer_row[2])
            COUNTS["released"] += done
            COUNTS["not_finished"] += not done
            final = final_outcome(job.outcome, grouped=False)
            recorded = done and answer_row is not None and answer_row[3]
            finished = [(job.token.task_id, final)] if recorded and final is not None else []
            self.releaser._released(job, ReleaseReport(released=done, finished=finished), local=True,
                                    granted=self.sent_at)
        if promotions:
            self.releaser.handoff.dispatch(promotions, local=False)


def install() -> None:
    """Patch ``Releaser.hand_over`` in this worker process (variant "keyed-loop-releases")."""
    thread_hand_over: Callable[..., None] = Releaser.hand_over

    def hand_over(self: Releaser, token: Token, fence: int, outcome: Any, *, key: str | None, name: str,
                  contended: bool, uncertain: bool = False, hold: Any = None, after: Callable[[], None] | None = None,
                  on_loop: bool = True, detail: str = "") -> None:
        loop: LoopReleases | None = getattr(self, "_loop_releases", None)
        waker = getattr(self.handoff, "_waker", None)
        if loop is None and on_loop and waker is not None:
            loop = LoopReleases(self, waker[0])
            self._loop_releases = loop  # type: ignore[attr-defined]
        if loop is None or not on_loop or contended or uncertain or hold is not None or key is None:
            COUNTS["to_thread"] += 1
            thread_hand_over(self, token, fence, outcome, key=key, name=name, contended=contended,
                             uncertain=uncertain, hold=hold, after=after, on_loop=on_loop, detail=detail)
            return
        loop.add(Release(
            token=token, fence=fence, outcome=outcome, key=key, name=name, contended=False, local_queues=None,
            local_tasks=None, uncertain=False, hold=None, released_at=metrics.clock(), detail=detail, after=after,
        ))

    Releaser.hand_over = hand_over  # type: ignore[method-assign]
    atexit.register(lambda: logger.warning("loop-releases: %s", COUNTS))
