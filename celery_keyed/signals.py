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

from celery_keyed.ledger import NEVER_RAN_KINDS

keyed_parked = Signal(name="keyed_parked", providing_args={"task_id", "task_name", "key"})
keyed_promoted = Signal(name="keyed_promoted", providing_args={"task_id", "task_name", "key", "local"})

#: The signal of each final outcome a task can get without running (``ledger/outcome_kinds.py``).
BY_OUTCOME: dict[str, Signal] = {
    kind.outcome.value: Signal(name=kind.signal, providing_args={"task_id", "task_name", "key", "detail"})
    for kind in NEVER_RAN_KINDS
}
keyed_rejected = BY_OUTCOME["rejected"]
keyed_expired = BY_OUTCOME["expired"]
keyed_superseded = BY_OUTCOME["superseded"]
keyed_revoked = BY_OUTCOME["revoked"]
keyed_lost = BY_OUTCOME["lost"]
keyed_dead_lettered = BY_OUTCOME["dead_lettered"]

#: The Celery event each never-ran outcome is announced with (``ledger/outcome_kinds.py``: ``expired`` is set for
#: an expiry). Every one carries ``keyed_outcome``.
EVENT_BY_OUTCOME: dict[str, str] = {
    kind.outcome.value: kind.event for kind in NEVER_RAN_KINDS if kind.event is not None
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
