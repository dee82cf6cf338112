"""Settling a task whose body ended but whose release never committed (D15), on real Postgres: the outcome is
booked once, only while the task has no attempt in the ledger, and a group moves on to its next member."""

from __future__ import annotations

import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger, Outcome, Token, Verdict


def _message(task_id: str) -> dict[str, object]:
    return {
        "task": "t", "body": "W1tdLCB7fSwge31d", "content_type": "application/json", "content_encoding": "utf-8",
        "headers": {"id": task_id, "task": "t"}, "properties": {}, "exchange": "", "routing_key": "celery",
    }  # fmt: skip


def test_a_lost_group_head_whose_result_is_stored_is_settled_and_its_group_moves_on(engine: sa.Engine) -> None:
    ledger = Ledger(engine, lease=60)
    head = ledger.admit(Arrival("h1", group_key="order:1", task_name="t", queue="celery", message=_message("h1")))
    assert head.verdict is Verdict.ADMITTED
    nxt = ledger.admit(Arrival("h2", group_key="order:1", task_name="t", queue="celery", message=_message("h2")))
    assert nxt.verdict is Verdict.PARKED
    assert ledger.settle("h1", "completed", detail="x") == (False, [])  # still running: not idle
    ledger.release(_token("h1"), head.fence, Outcome.WORKER_LOST)

    settled, promotions = ledger.settle("h1", "completed", detail="booked from its SUCCESS result")
    assert settled and [p.task_id for p in promotions] == ["h2"]
    assert ledger.settle("h1", "completed", detail="again") == (False, [])  # once
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT outcome FROM keyed_tasks WHERE task_id = 'h1'")).scalar() == "completed"


def test_a_failed_group_head_is_settled_as_dead_lettered(engine: sa.Engine) -> None:
    ledger = Ledger(engine, lease=60)
    head = ledger.admit(Arrival("f1", group_key="order:2", task_name="t", queue="celery", message=_message("f1")))
    ledger.release(_token("f1"), head.fence, Outcome.WORKER_LOST)
    assert ledger.settle("f1", "failed", detail="booked from its FAILURE result")[0]
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT outcome FROM keyed_tasks WHERE task_id = 'f1'")).scalar() == "dead_lettered"


def _token(task_id: str) -> Token:
    return Token(task_id, 0)
