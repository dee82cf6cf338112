"""A measurement of a design, not a feature: the worker's releases made from the consumer loop without blocking it.

``python -m bench.gate --only b --loop-releases`` runs gate b a third way (variant "keyed-loop-releases"): a keyed
worker whose outcome hooks, instead of handing each release to the releaser's thread, queue it on the loop; the loop
sends the queued releases in one ``keyed_release_and_promote`` call on a connection of its own, as a non-blocking
libpq query (``psycopg.pq``), and reads its rows when the hub says the connection's socket is readable, with one call
in flight at a time (what arrives meanwhile goes in the next call, as the releaser thread batches). Releases of keys
without a line wait up to the releaser's ``RELEASE_LINGER`` for company, as the thread's do.

With ``install_claims()`` too (variant "keyed-loop-ledger") the claims taken ahead at receipt are made the same way:
queued on the loop, sent in one ``keyed_claim_many`` call when the earliest of them may wait no longer (or sixteen
are queued), their verdicts acted on by the loop where it acted on the receipt service's (``Start._admitted``); the
parks at receipt stay with the service's thread. A claim the call did not admit is counted, and its request goes on
to its admission at pool-ready.

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
from celery_keyed.ledger import (  # the hot statements' modules, run here by hand (as bench.ledger reads its tables')
    Admission,
    Promotion,
    ReleaseReport,
    ReleaseRequest,
    Token,
    Verdict,
    admit,
    driver,
    fast_paths,
    outcomes,
    release,
)
from celery_keyed.worker.admission import LINGER_BATCH
from celery_keyed.worker.receipt import Receipt, _receipt_keys
from celery_keyed.worker.releaser import RELEASE_BATCH, RELEASE_LINGER, Release, Releaser
from celery_keyed.worker.running import Job, Prebound

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
CLAIM_SQL, CLAIM_NAMES = positional(driver.driver_sql(fast_paths.CLAIM_MANY))
COUNTS = {"calls": 0, "released": 0, "not_finished": 0, "promotions": 0, "to_thread": 0, "failed": 0,
          "claim_calls": 0, "claimed": 0, "not_claimed": 0}


def as_text(value: Any) -> bytes | None:
    """A parameter in libpq's text format (lists as array literals, as ``driver.run`` sends them)."""
    if value is None:
        return None
    if type(value) is list:
        literal = driver.array_literal([getattr(item, "value", item) for item in value])  # enums as their values
        assert literal is not None, value
        return literal.encode()
    return str(value).encode()


class LoopCalls:
    """One statement at a time sent from the consumer loop on a connection of its own, without blocking the loop:
    ``add`` queues a job (loop thread); the queue goes in one call once ``_wait_left`` says it may wait no longer (or
    ``batch`` are queued); the hub reads the answer when the connection's socket is readable and ``_answered`` acts
    on it; what was queued meanwhile goes in the next call."""

    sql: bytes
    names: list[str]
    batch: int

    def __init__(self, ledger: Any, hub: Any) -> None:
        self.ledger = ledger
        self.hub = hub
        self.sa_conn = ledger.autocommit.connect()  # the ledger's own set-up (timeouts, identity watch)
        self.conn = self.sa_conn.connection.driver_connection
        self.pgconn = self.conn.pgconn
        self.pgconn.nonblocking = 1
        self.socket = self.pgconn.socket
        self.transformer = Transformer(self.conn)
        self.queue: list[Any] = []
        self.oldest = 0.0  # monotonic time the oldest queued job was queued
        self.in_flight: list[Any] | None = None
        self.results: list[pq.abc.PGresult] = []
        self.scheduled = False
        self.sent_at = 0.0

    def add(self, job: Any) -> None:
        if not self.queue:
            self.oldest = time.monotonic()
        self.queue.append(job)
        if self.in_flight is None:
            self._send_or_wait()

    def _wait_left(self) -> float:
        """Seconds the queue may still wait for company."""
        raise NotImplementedError

    def _params(self, jobs: list[Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _answered(self, jobs: list[Any], answer: pq.abc.PGresult | None) -> None:
        """The call's answer (None, or not TUPLES_OK: it failed)."""
        raise NotImplementedError

    def _send_or_wait(self) -> None:
        left = self._wait_left()
        if len(self.queue) >= self.batch or left <= 0.0:
            self._send()
        elif not self.scheduled:
            self.scheduled = True
            self.hub.call_later(left, self._kick)

    def _kick(self) -> None:
        self.scheduled = False
        if self.in_flight is None and self.queue:
            self._send_or_wait()

    def _send(self) -> None:
        jobs, self.queue = self.queue[: self.batch], self.queue[self.batch :]
        self.oldest = time.monotonic()  # those left (a batch's overflow) are sent when this call ends
        params = self._params(jobs)
        self.sent_at = time.monotonic()  # before the call: a lower bound of every lease it starts
        self.pgconn.send_query_params(self.sql, [as_text(params[name]) for name in self.names])
        while self.pgconn.flush():
            pass
        self.in_flight, self.results = jobs, []
        self.hub.add_reader(self.socket, self._readable)

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
        if answer is not None and answer.status != pq.ExecStatus.TUPLES_OK:
            logger.warning("loop-releases: a call failed: %s", answer.error_message)
            COUNTS["failed"] += len(jobs)
            answer = None
        self._answered(jobs, answer)
        if self.queue:
            self._send_or_wait()

    def _rows(self, answer: pq.abc.PGresult) -> list[tuple[Any, ...]]:
        self.transformer.set_pgresult(answer)
        return self.transformer.load_rows(0, answer.ntuples, tuple)


class LoopReleases(LoopCalls):
    """The loop's releases of one releaser (``keyed_release_and_promote``); a release waits for company up to
    ``RELEASE_LINGER`` from when it was queued."""

    sql, names = SQL, NAMES
    batch = RELEASE_BATCH

    def __init__(self, releaser: Releaser, hub: Any) -> None:
        super().__init__(releaser.ledger, hub)
        self.releaser = releaser

    def _wait_left(self) -> float:
        return self.oldest + RELEASE_LINGER - time.monotonic()

    def _params(self, jobs: list[Release]) -> dict[str, Any]:
        COUNTS["calls"] += 1
        requests = [ReleaseRequest(job.token, job.fence, job.outcome, detail=job.detail) for job in jobs]
        return release.release_and_promote_params(
            requests, holder=self.ledger.holder, lease=self.ledger.lease, dispatch=self.ledger.dispatch
        )

    def _answered(self, jobs: list[Release], answer: pq.abc.PGresult | None) -> None:
        if answer is None:
            self.releaser.pending.extend(jobs)  # the heartbeat retries them
            return
        released: dict[int, tuple[Any, ...]] = {}
        promotions: list[Promotion] = []
        for row in self._rows(answer):
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
            final = outcomes.final_outcome(job.outcome, grouped=False)
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


class LoopClaims(LoopCalls):
    """The loop's claims taken ahead at receipt (``Receipt._ahead_job``'s jobs, ``keyed_claim_many``); the queue
    waits for company until the earliest time one of its claims may wait to (``Job.extra["by"]``), as the receipt
    service's thread lingers."""

    sql, names = CLAIM_SQL, CLAIM_NAMES
    batch = LINGER_BATCH

    def __init__(self, receipt: Receipt, gate: Any, hub: Any) -> None:
        super().__init__(receipt.ledger, hub)
        self.receipt = receipt
        self.gate = gate

    def _wait_left(self) -> float:
        return min(job.extra.get("by", 0.0) for job in self.queue) - time.monotonic()

    def _params(self, jobs: list[Job]) -> dict[str, Any]:
        COUNTS["claim_calls"] += 1
        arrivals = [job.arrival for job in jobs]
        return admit.claim_many_params(arrivals, holder=self.ledger.holder, lease=self.ledger.lease)

    def _answered(self, jobs: list[Job], answer: pq.abc.PGresult | None) -> None:
        """As ``Decide._claim_ahead``: an admitted claim waits in ``Handoff.prebound`` for its request; then the loop
        acts on the verdicts as on the receipt service's (``Start._admitted``)."""
        if answer is None:
            for job in jobs:
                job.error = RuntimeError("the loop's claim call failed")  # to its admission at pool-ready
        else:
            rows = {row[0]: row for row in self._rows(answer)}  # ord, new, fence, shard
            receipt, handoff = self.receipt, self.receipt.handoff
            for ordinal, job in enumerate(jobs, 1):
                row = rows.get(ordinal)
                if row is None or row[2] is None:
                    COUNTS["not_claimed"] += 1
                    job.result = (None, None)  # to its admission at pool-ready
                    continue
                COUNTS["claimed"] += 1
                job.result = (None, Admission(Verdict.ADMITTED, fence=row[2], shard=row[3]))
                with receipt.lock:
                    stale = (
                        receipt.closed or receipt.stopping.is_set()
                        or job.extra.get("generation") != receipt.generation
                    )
                    if not stale:
                        handoff.prebound[job.arrival.token] = Prebound(
                            row[2], job.arrival.key, granted=self.sent_at, ahead=True
                        )
        self.gate.starts._admitted(jobs)


def install_claims() -> None:
    """Patch ``Receipt._submit_receipt`` in this worker process: claims taken ahead go to the loop's ``LoopClaims``."""
    from celery_keyed.gate import current_gate

    service_submit: Callable[[Receipt, Job], bool] = Receipt._submit_receipt

    def submit(self: Receipt, job: Job) -> bool:
        waker = getattr(self.handoff, "_waker", None)
        gate = current_gate()
        if not job.extra.get("ahead") or waker is None or gate is None:
            return service_submit(self, job)
        loop: LoopClaims | None = getattr(self, "_loop_claims", None)
        if loop is None:
            loop = LoopClaims(self, gate, waker[0])
            self._loop_claims = loop  # type: ignore[attr-defined]
        for key in _receipt_keys(job):
            self._at_receipt[key] = self._at_receipt.get(key, 0) + 1
        loop.add(job)
        return True

    Receipt._submit_receipt = submit  # type: ignore[method-assign]
