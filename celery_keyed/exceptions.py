"""Exceptions stored as the result of keyed tasks that never ran (D11), so ``AsyncResult.get()``, chords and
errbacks complete instead of waiting forever."""

from __future__ import annotations


class KeyedOutcome(Exception):
    """Base class: the task never ran; ``outcome`` says why."""

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


BY_OUTCOME: dict[str, type[KeyedOutcome]] = {
    cls.outcome: cls
    for cls in (KeyedRejected, KeyedExpired, KeyedSuperseded, KeyedRevoked, KeyedLost, KeyedDeadLettered)
}
