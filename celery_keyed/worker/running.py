"""The running table and the lifecycle: the two pieces of state the worker's services share (with the records they
hand each other: ``Prebound``, a claim bound here waiting for a pool process; ``Job``, a request handed to an
admission service), passed to each by the
gate (celery_keyed/gate.py). This module imports no service: every service may import it.

- ``Running``: a claim this process holds (its request, attempt token and fence). The table (token -> ``Running``)
  is a plain dict under the gate's lock, written by the loop (admission on the loop, releases), the admission
  thread (a claim is tracked the moment it is taken, ``track``) and the heartbeat (lost claims); read by the
  heartbeat, the self-fence, the cancels and the snapshot.
- ``Lifecycle``: ``closed`` (shutdown began), ``stopping`` (the consumer is stopped), ``generation`` (consumer
  starts), ``started_at``, ``timers`` and ``loop_thread``: written by the gate's lifecycle (Celery's thread: the
  loop's, or a signal handler's), read by every thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery_keyed.ledger import HeldClaim, Token


@dataclass
class Running:
    """A claim this process holds: its request, attempt token and fence."""

    request: Any
    token: Token
    fence: int
    fenced: bool = False  # self-fencing already acted on it
    cancelled: str | None = None  # newest wins: a newer arrival asked it to stop (its detail), passed on here
    claimed_at: float = field(default_factory=time.monotonic)
    # Monotonic time taken before the ledger call that last set its lease was sent (the claim, then each renewal
    # that succeeded): the database counts the lease from that transaction's clock, which began after it, so the
    # lease cannot lapse before ``lease_from + keyed_lease`` (the self-fence's deadline, worker/fence.py, D19).
    lease_from: float = field(default_factory=time.monotonic)


@dataclass
class Prebound:
    """A promotion bound to this worker in its releaser's transaction (D4), whose request waits for a pool
    process. Its claim is renewed like a running one (D13); it is confirmed by a guarded statement when it
    starts (D14), and given back when it has waited too long (the line must not stay pinned to a busy pool)."""

    fence: int
    key: str | None
    since: float = field(default_factory=time.monotonic)
    # Monotonic time taken before the release call whose transaction bound it here, or None (bound another
    # way). The ledger gave its claim a lease of ``keyed_lease`` from the database's clock at that transaction,
    # which began after this instant: until ``granted + lease - self_fence_margin`` the claim cannot have lapsed
    # (see ``Handoff.take_fresh``).
    granted: float | None = None
    # Claimed ahead at receipt (``GateService.receive``, ``keyed_claim_ahead``) rather than promoted: its key has
    # no line, so starting it does not mark the key contended.
    ahead: bool = False


@dataclass
class Job:
    """One request waiting for its admission: what the loop knew when it handed it over, and the verdict the
    service's thread found (``result``)."""

    request: Any
    arrival: Any  # celery_keyed.ledger.Arrival
    submit: Callable[[], Any]  # Celery's own execute_using_pool: starts the request in its pool process
    result: Any = None  # set by the thread (see GateService._decide)
    error: BaseException | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Lifecycle:
    """Where the gate's lifecycle stands (one per worker process)."""

    closed: bool = False  # shutdown began: no local handoff; the heartbeat ends with the last tracked claim
    stopping: threading.Event = field(default_factory=threading.Event)  # the consumer is stopped
    generation: int = 0  # consumer starts: a decision handed back after a restart is stale
    started_at: float = 0.0  # monotonic time of the last consumer start
    timers: list[Any] = field(default_factory=list)  # the consumer loop's timers of this consumer start
    loop_thread: int | None = None  # the consumer loop's thread (events are sent from it only)


class FollowsLifecycle:
    """A service that reads the lifecycle (``life``) as its own ``closed``, ``stopping`` and ``generation``."""

    life: Lifecycle

    @property
    def closed(self) -> bool:
        return self.life.closed

    @property
    def stopping(self) -> threading.Event:
        return self.life.stopping

    @property
    def generation(self) -> int:
        return self.life.generation


def track(
    lock: threading.Lock,
    running: dict[Token, Running],
    request: Any,
    token: Token,
    fence: int,
    *,
    since: float | None = None,
    remember: Callable[[Any, Any], None] | None = None,
    arrival: Any = None,
) -> None:
    """Any thread: ``request`` holds the claim (token, fence); the heartbeat renews it from now on. ``since``: the
    monotonic time taken before the call that gave it its lease (unknown: now, which is later). ``remember``: told
    the claim and its ``arrival`` (what it holds: the failover watch takes it back after a failover, D20)."""
    if request.keyed_claim == (token, fence):
        return
    request.keyed_claim = (token, fence)
    entry = Running(request, token, fence) if since is None else Running(request, token, fence, lease_from=since)
    with lock:
        running[token] = entry
    if remember is not None:
        remember(HeldClaim(token.task_id, token.attempt, fence), arrival)
