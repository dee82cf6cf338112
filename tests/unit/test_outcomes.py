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


# -- the one table of outcome kinds (ledger/outcome_kinds.py) and everything that follows from it ---------------------


def test_the_table_has_every_outcome_once() -> None:
    from celery_keyed.ledger import OUTCOME_KINDS

    assert [kind.outcome for kind in OUTCOME_KINDS] == list(dict.fromkeys(kind.outcome for kind in OUTCOME_KINDS))
    assert {kind.outcome for kind in OUTCOME_KINDS} == set(TaskOutcome)
    assert {kind.outcome for kind in OUTCOME_KINDS if kind.ran} == {TaskOutcome.COMPLETED, TaskOutcome.FAILED}


def test_never_ran_is_the_tables() -> None:
    from celery_keyed.ledger import NEVER_RAN_KINDS

    assert tuple(kind.outcome for kind in NEVER_RAN_KINDS) == NEVER_RAN


def test_the_index_of_unnotified_tasks_lists_the_never_ran_outcomes() -> None:
    match = re.search(r"WHERE NOT notified AND outcome IN \(([^)]*)\)", schema_sql())
    assert match is not None
    assert set(re.findall(r"'([a-z_]+)'", match.group(1))) == {o.value for o in NEVER_RAN}


def test_each_never_ran_kind_has_its_exception_signal_and_event() -> None:
    from celery_keyed import exceptions, signals
    from celery_keyed.ledger import NEVER_RAN_KINDS

    for kind in NEVER_RAN_KINDS:
        cls = exceptions.BY_OUTCOME[kind.outcome.value]
        assert cls.__name__ == kind.exception and cls.outcome == kind.outcome.value
        signal = signals.BY_OUTCOME[kind.outcome.value]
        assert signal.name == kind.signal and getattr(signals, str(kind.signal)) is signal
        assert signals.EVENT_BY_OUTCOME[kind.outcome.value] == kind.event
    never_ran = {kind.outcome.value for kind in NEVER_RAN_KINDS}
    assert set(exceptions.BY_OUTCOME) == never_ran
    assert set(signals.BY_OUTCOME) == never_ran
    assert set(signals.EVENT_BY_OUTCOME) == never_ran
    assert {f"keyed_{o}" for o in never_ran} <= set(signals.__all__)

