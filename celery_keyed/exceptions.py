"""Exceptions stored as the result of keyed tasks that never ran (D11), so ``AsyncResult.get()``, chords and
errbacks complete instead of waiting forever."""

from __future__ import annotations


class KeyedOutcome(Exception):
    """Base class: the task never ran, or was stopped for good before its end; ``outcome`` says why."""

    outcome = "unknown"


class KeyedRejected(KeyedOutcome):
    """The key's waiting room was full (max_waiting), or the message's keys were malformed."""

    outcome = "rejected"


class KeyedExpired(KeyedOutcome):
    """The task could not start before its latest start (Celery ``expires`` or the name's ``max_wait``)."""

    outcome = "expired"


class KeyedSuperseded(KeyedOutcome):
    """A newer call with the same supersede key replaced this one in the waiting room, or cancelled it while it ran
    (``on_newer="cancel_running"``)."""

    outcome = "superseded"


class KeyedRevoked(KeyedOutcome):
    """The task was revoked while it waited in the ledger."""

    outcome = "revoked"


class KeyedLost(KeyedOutcome):
    """A registered group number never arrived and was skipped."""

    outcome = "lost"


class KeyedDeadLettered(KeyedOutcome):
    """A group head that failed for the last time; the group moved on."""

    outcome = "dead_lettered"


class KeyedCancelled(KeyedOutcome):
    """The worker stopped the body (Celery cancels the running tasks in a cold shutdown, and on a lost broker
    connection with ``worker_cancel_long_running_tasks_on_connection_loss``), and its message does not come back: it
    was acknowledged when the task started (``acks_late`` off). The task does not run again; booked failed."""

    outcome = "failed"


#: The never-ran outcomes' exceptions (a stopped body's ``KeyedCancelled`` is booked ``failed``: not in here).
BY_OUTCOME: dict[str, type[KeyedOutcome]] = {
    cls.outcome: cls
    for cls in (KeyedRejected, KeyedExpired, KeyedSuperseded, KeyedRevoked, KeyedLost, KeyedDeadLettered)
}
