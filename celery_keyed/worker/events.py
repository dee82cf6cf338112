"""Events, signals and the snapshot: what Celery's tools and ``celery keyed inspect`` see of the gate. Celery events
are sent from the consumer loop's thread only (kombu's channel is not thread-safe); from other threads they are
handed to the loop. Signals are sent with ``sender`` the gate.

Collaborators, given by the gate: the consumer (its event dispatcher), the lifecycle (the loop's thread, shutdown),
the running table and its lock, and, read by the snapshot only, the handoff, the ledger, the breaker, the releaser,
the revokes and the heartbeat. No state of its own. Also the warning, at each consumer start, about names whose
keys turn from mutexes into gates (``warn_prefix_capture``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from celery_keyed import exceptions, signals
from celery_keyed.ledger import Promotion, Token
from celery_keyed.worker.running import FollowsLifecycle, Lifecycle, Running

logger = logging.getLogger("celery_keyed")


#: The gate's own events. Not in Celery's ``task-`` group on purpose: Celery's state machine (celery.events.state, which
#: Flower and ``celery events`` use) takes any ``task-`` event it does not know as a state of its own that outranks
#: started, revoked and received, so a parked task that was then revoked, or promoted and started, stayed "parked" or
#: "promoted" there for good. Receivers that want them subscribe to these types (or to every event).
PARKED_EVENT = "keyed-parked"
PROMOTED_EVENT = "keyed-promoted"


def warn_prefix_capture(ledger: Any, limits: Mapping[str, Any]) -> None:
    """§3.11: configuring a name turns every ``name:*`` key from a mutex into a gate. Runs before the
    configuration is stored, and says so for each name the ledger has seen keys of while they were K = 1
    identities (unconfigured, or configured as 1) and that is now configured with another limit."""
    names = sorted(n for n, c in limits.items() if c.limit != 1)
    if not names:
        return
    for row in ledger.captured_keys(names):
        limit = limits[row.name].limit
        logger.warning(
            "celery-keyed: name %r is now configured with limit %d: its %d known keys (e.g. %r) were mutexes "
            "(K = 1) until now; every %s:* key is a gate of %d from here on",
            row.name,
            limit,
            row.n,
            row.example,
            row.name,
            limit,
        )


class Events(FollowsLifecycle):
    """The announcements and the snapshot of one worker process."""

    def __init__(
        self,
        *,
        sender: Any,
        consumer: Any,
        life: Lifecycle,
        lock: threading.Lock,
        running: dict[Token, Running],
        handoff: Any,
        ledger: Any,
        breaker: Any,
        releaser: Any,
        revokes: Any,
        heartbeat: Any,
    ) -> None:
        self.sender = sender
        self.consumer = consumer
        self.life = life
        self.lock = lock
        self.running = running
        self.handoff = handoff
        self.ledger = ledger
        self.breaker = breaker
        self.releaser = releaser
        self.revokes = revokes
        self.heartbeat = heartbeat

    def snapshot(self) -> dict[str, Any]:
        """What this gate holds now, JSON-able: running attempts, promotions handed here waiting for a pool
        process, requests held while the ledger is unreachable, releases not committed yet, the breaker."""
        now = time.monotonic()
        with self.lock:
            running = [
                {
                    "task_id": r.token.task_id,
                    "attempt": r.token.attempt,
                    "fence": r.fence,
                    "task": getattr(r.request, "name", ""),
                    "key": getattr(r.request, "keyed_arrival_key", None),
                    "started": bool(getattr(r.request, "keyed_started", False)),
                    "held_for": round(now - r.claimed_at, 3),
                    "fenced": r.fenced,
                    "cancelled": r.cancelled,
                }
                for r in self.running.values()
            ]
            prebound = [
                {
                    "task_id": t.task_id,
                    "attempt": t.attempt,
                    "fence": p.fence,
                    "key": p.key,
                    "waiting_for": round(now - p.since, 3),
                }
                for t, p in self.handoff.prebound.items()
            ]
        return {
            "holder": self.ledger.holder,
            "ledger_reachable": not self.breaker.is_open,
            "shutting_down": self.closed,
            "running": running,
            "handed_over": prebound,
            "held": [{"task_id": r.id, "task": r.name} for r in list(self.breaker.held)],
            "pending_releases": [
                {"task_id": j.token.task_id, "attempt": j.token.attempt, "outcome": j.outcome.value}
                for j in list(self.releaser.pending)
            ],
            "pending_revokes": list(self.revokes.pending),
            "last_renewal_ago": round(now - self.heartbeat.last_renewal, 3),
        }

    def _emit(self, event_type: str, **fields: Any) -> None:
        """Send a Celery event, as the worker's own events are sent: from the consumer loop's thread (kombu's
        channel is not thread-safe), handed to it from other threads; nothing when events are off (``-E``)."""
        dispatcher = getattr(self.consumer, "event_dispatcher", None)
        if dispatcher is None or not getattr(dispatcher, "enabled", False):
            return
        if threading.get_ident() == self.life.loop_thread:
            try:
                dispatcher.send(event_type, **fields)
            except Exception:
                logger.debug("celery-keyed: could not send %s", event_type, exc_info=True)
        elif self.handoff.loop_runs():
            self.handoff.defer(lambda: self._emit(event_type, **fields))

    def _announce_parked(self, task_id: str, task_name: str, key: str | None) -> None:
        logger.debug("celery-keyed: %s[%s] parked in the line of %s", task_name, task_id, key)
        signals.keyed_parked.send(sender=self.sender, task_id=task_id, task_name=task_name, key=key)
        self._emit(PARKED_EVENT, uuid=task_id, name=task_name, key=key)

    def announce_promoted(self, promotion: Promotion, *, local: bool) -> None:
        name = (promotion.message or {}).get("task") or ""
        logger.debug(
            "celery-keyed: %s[%s] promoted into a slot of %s (%s)",
            name,
            promotion.task_id,
            promotion.key,
            "started here" if local else "published",
        )
        signals.keyed_promoted.send(
            sender=self.sender, task_id=promotion.task_id, task_name=name, key=promotion.key, local=local
        )
        self._emit(PROMOTED_EVENT, uuid=promotion.task_id, name=name, key=promotion.key, local=local)

    def announce_never_ran(self, task_id: str, outcome: str, detail: str, task_name: str, key: str | None) -> None:
        """A final outcome without a run (rejected, expired, superseded, revoked, lost, dead-lettered): its signal,
        and the Celery event Flower and ``celery events`` understand (task-rejected / task-revoked / task-failed,
        with ``keyed_outcome``), so the task does not look received for ever."""
        signal = signals.BY_OUTCOME.get(outcome)
        if signal is not None:
            signal.send(sender=self.sender, task_id=task_id, task_name=task_name, key=key, detail=detail)
        event = signals.EVENT_BY_OUTCOME.get(outcome)
        if event is None:
            return
        fields: dict[str, Any] = {"uuid": task_id, "keyed_outcome": outcome, "keyed_key": key, "detail": detail}
        exc = exceptions.BY_OUTCOME.get(outcome, exceptions.KeyedOutcome)(detail)
        failure = {"exception": repr(exc), "traceback": ""}
        if event == "task-rejected":
            # Celery's rejected state ranks below received in its state machine (celery.events.state, which Flower
            # and ``celery events`` use): after task-rejected alone a task shows as received for ever. Its result is
            # the KeyedRejected failure, which task-failed says, and which the state machine keeps.
            self._emit(event, **fields, requeue=False)
            self._emit("task-failed", **fields, **failure)
            return
        if event == "task-revoked":
            fields.update(terminated=False, signum=None, expired=outcome == "expired")
        else:
            fields.update(failure)
        self._emit(event, **fields)
