"""The running table and the lifecycle: the two pieces of state the worker's services share, passed to each by the
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
from dataclasses import dataclass, field
from typing import Any

from celery_keyed.ledger import Token


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
) -> None:
    """Any thread: ``request`` holds the claim (token, fence); the heartbeat renews it from now on. ``since``: the
    monotonic time taken before the call that gave it its lease (unknown: now, which is later)."""
    if request.keyed_claim == (token, fence):
        return
    request.keyed_claim = (token, fence)
    entry = Running(request, token, fence) if since is None else Running(request, token, fence, lease_from=since)
    with lock:
        running[token] = entry
