"""The task outcomes of the ledger's code are exactly the schema's (CHECK keyed_tasks_outcome_known)."""

from __future__ import annotations

import re

from celery_keyed.ledger import TaskOutcome
from celery_keyed.ledger.books import NEVER_RAN
from celery_keyed.ledger.migrations import schema_sql


def _check_values(constraint: str) -> set[str]:
    match = re.search(rf"CONSTRAINT {constraint} CHECK \(outcome IN \(([^)]*)\)\)", schema_sql())
    assert match is not None, constraint
    return set(re.findall(r"'([a-z_]+)'", match.group(1)))


def test_task_outcomes_are_the_schemas() -> None:
    assert {o.value for o in TaskOutcome} == _check_values("keyed_tasks_outcome_known")
    assert {o.value for o in TaskOutcome} == _check_values("keyed_books_pruned_outcome_known")


def test_never_ran_is_every_outcome_but_a_run() -> None:
    assert set(NEVER_RAN) == set(TaskOutcome) - {TaskOutcome.COMPLETED, TaskOutcome.FAILED}
    assert TaskOutcome.EXPIRED == "expired"  # a StrEnum: the value is what the books and the results hold
