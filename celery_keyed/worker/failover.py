"""Failover (D20): a worker process that finds the ledger on another server keeps its running bodies.

A standby promoted after the primary died may lack the primary's last commits, among them the claims of attempts this
process still runs. The heartbeat then finds those claims gone. Before a failover that means "reclaimed" and the body
is stopped (worker/fence.py); after one it means "lost with the old server", and ``FailoverWatch.reassert`` takes each
claim back on the new server, with its fence, under the slot guard (``keyed_claims_reassert``). Only a refused
re-assertion (the slot was taken meanwhile, or the claim held a group or several keys) leaves the body to the
self-fence, which stops it, and the body runs again (``fence.readmit_fenced``). Meanwhile the ledger admits no new
start for one lease (the trigger of migration 0025): every claim the old server granted has been renewed here,
re-asserted, or stopped by its worker's self-fence by then.

``FailoverWatch.beat`` runs in the heartbeat's thread after each renewal that succeeded: it checks the server's
identity (logged and counted once per change, ``FailoverLedger.changes``) and remembers what each held claim holds
(read from the ledger once per claim), which is what a re-assertion needs.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from celery_keyed import metrics
from celery_keyed.ledger import Arrival, ClaimHolding, FailoverLedger, HeldClaim, Ledger, key_name
from celery_keyed.messages import republish_received

if TYPE_CHECKING:
    from celery_keyed.worker.running import Running

logger = logging.getLogger("celery_keyed")


#: Seconds a parked request is remembered at least (the replication lag a failover may lose, and then some).
PARKED_JOURNAL_WINDOW = 60.0

#: The most parked requests a worker remembers (each holds its message's body until it ages out).
PARKED_JOURNAL_MAX = 10_000


class FailoverWatch:
    """The failover watch of one gate's heartbeat. ``ledger``: returns the gate's ledger; ``lease``: the claims'
    lease (also how long after a failover a missing claim is taken for lost with the old server, not reclaimed);
    ``releaser``: returns the gate's releaser (a release lost with the old server is handed to it again)."""

    def __init__(self, ledger: Callable[[], Ledger], releaser: Callable[[], Any], *, lease: float) -> None:
        self._ledger = ledger
        self._releaser = releaser
        self.lease = lease
        self.holdings: dict[HeldClaim, ClaimHolding] = {}  # under _lock: remember (loop) and beat (heartbeat) write it
        self._seen: dict[HeldClaim, int] = {}  # the beat at which each claim was last held
        self._beats = 0
        self._lock = threading.Lock()
        self.failover_at: float | None = None  # monotonic time this process first saw the last failover
        self._changes_counted: int | None = None  # the changes of the ledger's memory counted (None: not looked yet)
        with contextlib.suppress(Exception):  # a gate's ledger exists by now (a test's fake gate may have none)
            self._changes_counted = self.statements.changes()
        #: Requests parked (their messages acknowledged) lately: (monotonic time, request). After a failover, those the
        #: new server has no trace of are published again (``settle_parked``). Consumer loop appends, heartbeat reads.
        self.parked: deque[tuple[float, Any]] = deque(maxlen=PARKED_JOURNAL_MAX)
        #: Releases committed lately: (monotonic time, release). After a failover, those whose outcome the new server
        #: lacks are given again (``settle_released``). The releaser's thread appends, the heartbeat reads.
        self.released: deque[tuple[float, Any]] = deque(maxlen=PARKED_JOURNAL_MAX)
        self._settle = False  # a failover was seen: settle the journals at the next beat

    @property
    def ledger(self) -> Ledger:
        """The gate's ledger (looked up when used: the watch is made before the gate has one in tests)."""
        return self._ledger()

    @property
    def statements(self) -> FailoverLedger:
        """The ledger's failover statements for this process's holder."""
        ledger = self.ledger
        return FailoverLedger(ledger.engine, ledger.holder)

    def remember(self, claim: HeldClaim, arrival: Arrival | None) -> None:
        """Any thread: a claim this process now holds, and what it holds (from its arrival; None: read from the
        ledger at the next beat)."""
        if arrival is None or arrival.key is None:
            return
        holding = ClaimHolding(
            claim.task_id,
            claim.attempt,
            claim.fence,
            arrival.key,
            None,  # its shard: any where it fits
            arrival.cost,
            key_name(arrival.key),
            composite=bool(arrival.extra_keys or arrival.group_key),
        )
        with self._lock:
            self.holdings[claim] = holding
            self._seen[claim] = self._beats

    def after_renewal(self, held: Iterable[HeldClaim]) -> None:
        """The heartbeat, after a renewal that succeeded: ``beat``, whose failure never stops the heartbeat (the
        ledger unreachable: the next beat checks again)."""
        try:
            self.beat(held)
        except sa.exc.SQLAlchemyError:
            pass
        except Exception:
            logger.exception("celery-keyed: the failover watch failed")

    def take_back(self, missing: Mapping[HeldClaim, Running], sent: float) -> list[Running]:
        """The heartbeat: of the attempts whose claims a renewal did not find (``missing``), those lost (reclaimed:
        the caller stops them at once). After a failover none is: each claim is re-asserted (its lease then counts
        from ``sent``, the time before the renewal), and one refused (its slot still held, e.g. by a claim whose
        release the failover lost and whose worker gives it again) is tried again at the next beat until the
        self-fence's deadline stops its body, which is before the hold on new starts ends. Never raises: a failure
        leaves every one lost."""
        if not missing:
            return []
        try:
            if not self.after_failover():
                return list(missing.values())
            kept = self.reassert((c, r.request.name) for c, r in missing.items())
        except Exception:
            logger.exception("celery-keyed: the failover watch failed")
            return list(missing.values())
        for claim in kept:
            missing[claim].lease_from = max(missing[claim].lease_from, sent)
        return []

    def beat(self, held: Iterable[HeldClaim]) -> None:
        """After a renewal that succeeded: check the server's identity; remember what newly held claims hold."""
        held = set(held)
        with self._lock:
            new = [(c.task_id, c.attempt, c.fence) for c in held if c not in self.holdings]
        found = self.statements.check(lease=self.lease, held=new)
        self.counted()
        with self._lock:
            self._beats += 1
            for holding in found:
                self.holdings[HeldClaim(holding.task_id, holding.attempt, holding.fence)] = holding
            for claim in held:
                self._seen[claim] = self._beats
            # forget what is no longer held (a claim remembered since the snapshot ``held`` was taken is kept)
            for claim in [c for c, beat in self._seen.items() if beat < self._beats - 1]:
                self._seen.pop(claim, None)
                self.holdings.pop(claim, None)
        if self._settle:
            self._settle = False
            self.settle_parked()
            self.settle_released()

    def journal_released(self, release: Any) -> None:
        """Releaser: ``release`` (a ``worker.releaser.Release``) has committed."""
        now = time.monotonic()
        window = max(2 * self.lease, PARKED_JOURNAL_WINDOW)
        while self.released and now - self.released[0][0] > window:
            self.released.popleft()
        self.released.append((now, release))

    def settle_released(self) -> int:
        """After a failover: the releases committed here lately whose outcome the new server lacks. A claim it still
        holds with the release's fence is released again (through ``give_back``: its slot back, its outcome booked,
        the next waiters promoted); an attempt it has no trace of gets its final outcome booked
        (``keyed_books_settle``). How many were settled."""
        journal = {(r.token.task_id, r.token.attempt): r for _, r in list(self.released)}
        if not journal:
            return 0
        missing = self.statements.without_outcome(list(journal))
        settled = 0
        for token, fence in missing.items():
            release = journal[token]
            if fence == release.fence:
                self._releaser().hand_over(
                    release.token, release.fence, release.outcome, key=release.key, name=release.name,
                    contended=True, on_loop=False, detail=release.detail,
                )  # fmt: skip
                settled += 1
                continue
            if fence is not None:
                continue  # another claim of the attempt: its holder books it
            if self.statements.settle(
                task_id=token[0],
                attempt=token[1],
                task_name=release.name,
                key=release.key,
                outcome=str(release.outcome),
            ):
                settled += 1
        if settled:
            logger.warning("celery-keyed: %d outcomes lost in the ledger failover were booked again", settled)
        return settled

    def journal_parked(self, request: Any) -> None:
        """Consumer loop: ``request`` was parked and its message acknowledged (the ledger holds it now)."""
        now = time.monotonic()
        window = max(2 * self.lease, PARKED_JOURNAL_WINDOW)
        while self.parked and now - self.parked[0][0] > window:
            self.parked.popleft()
        self.parked.append((now, request))

    def settle_parked(self) -> list[str]:
        """After a failover: publish again, as received, every request parked here lately of which the new server has
        no trace (its parked row was lost with the old server's last commits; its message was acknowledged). The copy
        is admitted like any delivery. Task ids published again."""
        journal = list(self.parked)
        if not journal:
            return []
        by_token = {(r.id, int((getattr(r, "_request_dict", None) or {}).get("retries") or 0)): r for _, r in journal}
        unknown = self.statements.unknown(list(by_token))
        sent = []
        for token in unknown:
            request = by_token[token]
            try:
                republish_received(request.app, request)
            except Exception:
                logger.exception(
                    "celery-keyed: could not publish %s[%s] again after the failover", request.name, request.id
                )
                continue
            sent.append(request.id)
            logger.warning(
                "celery-keyed: %s[%s] was parked on the ledger's previous server and lost in the failover; "
                "published again",
                request.name,
                request.id,
            )
        return sent

    def counted(self) -> None:
        """Count the failovers this process saw since the last call (the connection hook may have seen it first)."""
        changes = self.statements.changes()
        if self._changes_counted is None:
            self._changes_counted = changes
        if changes > self._changes_counted:
            metrics.failover(changes - self._changes_counted)
            self._changes_counted = changes
            self.failover_at = time.monotonic()
            self._settle = True

    def after_failover(self) -> bool:
        """Whether a failover was seen recently enough that a missing claim may be one lost with the old server."""
        self.counted()
        return self.failover_at is not None and time.monotonic() - self.failover_at < 2 * self.lease

    def reassert(self, lost: Iterable[tuple[HeldClaim, str]]) -> set[HeldClaim]:
        """Take back the claims ``lost`` (claim, task name) after a failover; those re-asserted (or found kept). A
        refused or failed one is left to the caller (the self-fence stops its body)."""
        if not self.after_failover():
            return set()
        kept: set[HeldClaim] = set()
        for claim, task_name in lost:
            with self._lock:
                holding = self.holdings.get(claim)
            if holding is None:
                continue
            try:
                verdict = self.statements.reassert(holding, task_name=task_name, lease=self.lease)
            except Exception:
                logger.exception("celery-keyed: could not re-assert the claim of %s[%s]", task_name, claim.task_id)
                continue
            metrics.reasserted(verdict)
            if verdict == "refused":
                logger.warning(
                    "celery-keyed: %s[%s]: its claim was lost in the ledger failover and its slot is held; tried again "
                    "until its lease would end (then it is stopped and runs again)",
                    task_name,
                    claim.task_id,
                )
                continue
            logger.warning(
                "celery-keyed: %s[%s] keeps running: its claim, lost in the ledger failover, was re-asserted (%s)",
                task_name,
                claim.task_id,
                verdict,
            )
            kept.add(claim)
        return kept
