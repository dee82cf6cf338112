"""A measurement of a design, not a feature: the worker's releases made from the consumer loop without blocking it.

``python -m bench.gate --only b --loop-releases`` runs gate b a third way (variant "keyed-loop-releases"): a keyed
worker whose outcome hooks, instead of handing each release to the releaser's thread, queue it on the loop; the loop
sends the queued releases in one ``keyed_release_and_promote`` call on a connection of its own, as a non-blocking
libpq query (``psycopg.pq``), and reads its rows when the hub says the connection's socket is readable, with one call
in flight at a time (what arrives meanwhile goes in the next call, as the releaser thread batches). Releases of keys
without a line wait up to the releaser's ``RELEASE_LINGER`` for company, as the thread's do.

With ``install(claims=True)`` (variant "keyed-loop-ledger") the claims taken ahead at receipt are made the same way:
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
from celery_keyed.ledger import Admission, Promotion, ReleaseReport, Token, Verdict, driver, fast_paths
from celery_keyed.ledger.outcomes import final_outcome
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


class LoopClaims:
    """The loop's claims taken ahead at receipt (``Receipt._ahead_job``'s jobs): ``add`` queues one (loop thread)."""

    def __init__(self, receipt: Receipt, gate: Any, hub: Any) -> None:
        self.receipt = receipt
        self.gate = gate
        self.hub = hub
        self.sa_conn = receipt.ledger.autocommit.connect()
        self.conn = self.sa_conn.connection.driver_connection
        self.pgconn = self.conn.pgconn
        self.pgconn.nonblocking = 1
        self.socket = self.pgconn.socket
        self.transformer = Transformer(self.conn)
        self.queue: list[Job] = []
        self.in_flight: list[Job] | None = None
        self.results: list[pq.abc.PGresult] = []
        self.scheduled = False
        self.granted = 0.0

    def add(self, job: Job) -> None:
        self.queue.append(job)
        if self.in_flight is None:
            self._send_or_wait()

    def _send_or_wait(self) -> None:
        """As the receipt service's thread lingers: until the earliest time a queued claim may wait to, or a batch."""
        left = min(job.extra.get("by", 0.0) for job in self.queue) - time.monotonic()
        if len(self.queue) >= LINGER_BATCH or left <= 0.0:
            self._send()
        elif not self.scheduled:
            self.scheduled = True
            self.hub.call_later(left, self._kick)

    def _kick(self) -> None:
        self.scheduled = False
        if self.in_flight is None and self.queue:
            self._send_or_wait()

    def _send(self) -> None:
        jobs, self.queue = self.queue[:64], self.queue[64:]
        arrivals = [job.arrival for job in jobs]
        ledger = self.receipt.ledger
        params: dict[str, Any] = {
            "task_ids": [a.task_id for a in arrivals],
            "attempts": [a.attempt for a in arrivals],
            "task_names": [a.task_name for a in arrivals],
            "keys": [a.key for a in arrivals],
            "deadlines": [a.deadline for a in arrivals],
            "costs": [a.cost for a in arrivals],
            "fair_keys": [a.fair_key for a in arrivals],
            "holder": ledger.holder,
            "lease": ledger.lease,
            "now": None,
        }
        self.granted = time.monotonic()  # before the call: a lower bound of every claim's lease start
        self.pgconn.send_query_params(CLAIM_SQL, [as_text(params[name]) for name in CLAIM_NAMES])
        while self.pgconn.flush():
            pass
        self.in_flight, self.results = jobs, []
        self.hub.add_reader(self.socket, self._readable)
        COUNTS["claim_calls"] += 1

    def _readable(self, *args: Any) -> None:
        self.pgconn.consume_input()
        while not self.pgconn.is_busy():
            result = self.pgconn.get_result()
            if result is None:
                break
            self.results.append(result)
        else:
            return
        self.hub.remove_reader(self.socket)
        jobs, self.in_flight = self.in_flight or [], None
        answer = self.results[-1] if self.results else None
        if answer is None or answer.status != pq.ExecStatus.TUPLES_OK:
            message = answer.error_message if answer is not None else b"no answer"
            for job in jobs:
                job.error = RuntimeError(f"loop claim failed: {message!r}")
            COUNTS["failed"] += len(jobs)
        else:
            self._settle(jobs, answer)
        self.gate.starts._admitted(jobs)  # on the loop, as the receipt service's verdicts are acted on
        if self.queue:
            self._send_or_wait()

    def _settle(self, jobs: list[Job], answer: pq.abc.PGresult) -> None:
        """As ``Decide._claim_ahead``: an admitted claim waits in ``Handoff.prebound`` for its request."""
        self.transformer.set_pgresult(answer)
        rows = {row[0]: row for row in self.transformer.load_rows(0, answer.ntuples, tuple)}  # ord, new, fence, shard
        receipt, handoff = self.receipt, self.receipt.handoff
        for ordinal, job in enumerate(jobs, 1):
            row = rows.get(ordinal)
            if row is None or row[2] is None:
                COUNTS["not_claimed"] += 1
                job.result = (None, None)  # to its admission at pool-ready
                continue
            COUNTS["claimed"] += 1
            admission = Admission(Verdict.ADMITTED, fence=row[2], shard=row[3])
            job.result = (None, admission)
            with receipt.lock:
                stale = receipt.closed or receipt.stopping.is_set() or job.extra.get("generation") != receipt.generation
                if not stale:
                    handoff.prebound[job.arrival.token] = Prebound(
                        row[2], job.arrival.key, granted=self.granted, ahead=True
                    )


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
