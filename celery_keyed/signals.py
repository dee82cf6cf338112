"""Signals of the gate, sent in the worker's main process (``celery.utils.dispatch.Signal``, like Celery's own).

Connect as with Celery's signals::

    from celery_keyed.signals import keyed_parked

    @keyed_parked.connect
    def on_parked(sender, task_id, task_name, key, **kwargs): ...

``sender`` is the worker's gate. Every signal carries ``task_id``, ``task_name`` and ``key`` (the concurrency key,
or the group key; None when unknown); the outcome signals carry ``detail`` too. A receiver that raises is logged
by Celery's dispatcher and does not disturb the gate.

- ``keyed_parked``: a task was not admitted and waits in the ledger (its message is acked).
- ``keyed_promoted``: a slot was given to a parked task; it is started here or published with its admission
  token (``local``: started by this worker).
- ``keyed_rejected``, ``keyed_expired``, ``keyed_superseded``, ``keyed_revoked``, ``keyed_lost``,
  ``keyed_dead_lettered``: a task got that final outcome without running (its result is a ``Keyed*`` failure).
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

keyed_parked = Signal(name="keyed_parked", providing_args={"task_id", "task_name", "key"})
keyed_promoted = Signal(name="keyed_promoted", providing_args={"task_id", "task_name", "key", "local"})
keyed_rejected = Signal(name="keyed_rejected", providing_args={"task_id", "task_name", "key", "detail"})
keyed_expired = Signal(name="keyed_expired", providing_args={"task_id", "task_name", "key", "detail"})
keyed_superseded = Signal(name="keyed_superseded", providing_args={"task_id", "task_name", "key", "detail"})
keyed_revoked = Signal(name="keyed_revoked", providing_args={"task_id", "task_name", "key", "detail"})
keyed_lost = Signal(name="keyed_lost", providing_args={"task_id", "task_name", "key", "detail"})
keyed_dead_lettered = Signal(name="keyed_dead_lettered", providing_args={"task_id", "task_name", "key", "detail"})

#: The signal of each final outcome a task can get without running.
BY_OUTCOME: dict[str, Signal] = {
    "rejected": keyed_rejected,
    "expired": keyed_expired,
    "superseded": keyed_superseded,
    "revoked": keyed_revoked,
    "lost": keyed_lost,
    "dead_lettered": keyed_dead_lettered,
}

#: The Celery event each never-ran outcome is announced with, as Celery's own semantics fit: a task turned away
#: is ``task-rejected``; one that expired, was revoked or replaced is ``task-revoked`` (``expired`` set for the
#: first); one that was lost or dead-lettered is ``task-failed``. Every one carries ``keyed_outcome``.
EVENT_BY_OUTCOME: dict[str, str] = {
    "rejected": "task-rejected",
    "expired": "task-revoked",
    "superseded": "task-revoked",
    "revoked": "task-revoked",
    "lost": "task-failed",
    "dead_lettered": "task-failed",
}

__all__ = [
    "BY_OUTCOME",
    "EVENT_BY_OUTCOME",
    "keyed_dead_lettered",
    "keyed_expired",
    "keyed_lost",
    "keyed_parked",
    "keyed_promoted",
    "keyed_rejected",
    "keyed_revoked",
    "keyed_superseded",
]
