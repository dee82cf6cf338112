"""The one table of a task's final outcomes: for each kind (``TaskOutcome``, the books' ``keyed_tasks.outcome``)
whether its body ran, how people read it, the exception stored as the result of a task that never ran, and the
Celery event that announces it.

Everything else follows from this table or is checked against it (tests/unit/test_outcomes.py):

- ``books.NEVER_RAN`` (the outcomes whose failure result the worker stores, D11) is derived from it;
- ``celery_keyed.exceptions.BY_OUTCOME`` maps each never-ran kind to its ``Keyed*`` exception (the class named here);
- ``celery_keyed.signals``: one signal ``keyed_<outcome>`` per never-ran kind, and its Celery event, derived;
- the Django app's choices (``celery_keyed_django.models.OUTCOMES``) are the kinds with their labels, derived;
- the schema's CHECKs (``keyed_tasks_outcome_known``, ``keyed_books_pruned_outcome_known``) and the partial index
  of unnotified tasks list exactly these values (checked by the test).

Adding a kind: a value in ``TaskOutcome``, a row here, its exception class, a migration for the CHECKs.
"""

from __future__ import annotations

from dataclasses import dataclass

from celery_keyed.ledger.attempts import TaskOutcome


@dataclass(frozen=True)
class OutcomeKind:
    """One final outcome. ``ran``: its body ran (its result is the body's own); otherwise it never ran (or was
    stopped for good) and the worker stores ``exception`` as its failure result and sends ``event``."""

    outcome: TaskOutcome
    label: str
    ran: bool = False
    exception: str | None = None  # a class of celery_keyed.exceptions
    event: str | None = None  # the Celery event announcing it

    @property
    def signal(self) -> str | None:
        """The name of its signal in ``celery_keyed.signals`` (never-ran kinds only)."""
        return None if self.ran else f"keyed_{self.outcome.value}"


#: The kinds, in the order people see them (the Django app's choices). Events as Celery's own semantics fit: a task
#: turned away is ``task-rejected``; one that expired, was revoked or replaced is ``task-revoked``; one that was lost
#: or dead-lettered is ``task-failed``.
OUTCOME_KINDS: tuple[OutcomeKind, ...] = (
    OutcomeKind(TaskOutcome.COMPLETED, "completed", ran=True),
    OutcomeKind(TaskOutcome.FAILED, "failed", ran=True),
    OutcomeKind(TaskOutcome.DEAD_LETTERED, "dead-lettered", exception="KeyedDeadLettered", event="task-failed"),
    OutcomeKind(TaskOutcome.EXPIRED, "expired before start", exception="KeyedExpired", event="task-revoked"),
    OutcomeKind(TaskOutcome.REJECTED, "rejected (waiting room full)", exception="KeyedRejected", event="task-rejected"),
    OutcomeKind(TaskOutcome.SUPERSEDED, "superseded", exception="KeyedSuperseded", event="task-revoked"),
    OutcomeKind(TaskOutcome.REVOKED, "revoked", exception="KeyedRevoked", event="task-revoked"),
    OutcomeKind(TaskOutcome.LOST, "lost (never received)", exception="KeyedLost", event="task-failed"),
)

#: The kinds of tasks that never ran: the worker stores their ``Keyed*`` failure result (D11).
NEVER_RAN_KINDS: tuple[OutcomeKind, ...] = tuple(kind for kind in OUTCOME_KINDS if not kind.ran)
