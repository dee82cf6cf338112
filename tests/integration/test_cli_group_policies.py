"""``celery keyed resume-group`` / ``skip-group-head`` and held groups in ``status`` and ``explain``, on a real
ledger (a group whose name's ``group_failure`` is ``hold``, after its head failed)."""

from __future__ import annotations

from celery import Celery

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict
from tests.integration.test_cli import app, run, run_json

__all__ = ["app"]


def _held_group(ledger: Ledger, group: str, head: str, nxt: str) -> None:
    ledger.configure({"order": NameConfig("order", group_failure="hold"), "api": NameConfig("api", limit=3)})
    admitted = ledger.admit(Arrival(head, group_key=group))
    assert admitted.admitted
    assert ledger.admit(Arrival(nxt, group_key=group)).verdict is Verdict.PARKED
    ledger.release(Token(head, 0), admitted.fence, Outcome.FAILED, detail="KeyError('sku')")


def test_a_held_group_in_status_and_explain_then_resumed(app: Celery, engine, scalar) -> None:
    ledger = Ledger(engine)
    _held_group(ledger, "order:1", "h1", "n1")
    status = run_json(app, "status")
    (held,) = status["held_groups"]
    assert held["group_key"] == "order:1" and held["task_id"] == "h1" and held["members"] == 1
    assert held["reason"] == "its head h1 (attempt 0) failed: KeyError('sku')"
    assert {n["name"]: n["group_failure"] for n in status["names"]}["order"] == "hold"
    text = run(app, "status").stdout
    assert "held group" in text and "KeyError('sku')" in text and "celery keyed resume-group GROUP_KEY" in text
    assert "a group head that fails holds its group until an operator resumes it or skips the head" in text
    explained = run_json(app, "explain", "n1")
    assert explained["state"] == "held" and "resume-group order:1" in explained["text"]
    resumed = run_json(app, "resume-group", "order:1", "--reason", "fixed", "--author", "ops")
    assert resumed == {"group_key": "order:1", "resumed": True, "failed_head": "h1", "promoted": 1}
    assert run_json(app, "resume-group", "order:1")["resumed"] is False
    assert "not held" in run(app, "resume-group", "order:1").stdout
    assert run_json(app, "status")["held_groups"] == []
    assert scalar("SELECT detail FROM keyed_events WHERE kind = 'group_resumed'") == "by ops: fixed"


def test_skip_the_failed_head_of_a_held_group(app: Celery, engine) -> None:
    ledger = Ledger(engine)
    _held_group(ledger, "order:2", "h2", "n2")
    skipped = run_json(app, "skip-group-head", "order:2", "--reason", "poison")
    assert skipped == {"group_key": "order:2", "held": True, "failed_head": "h2", "dead_lettered": False, "promoted": 1}
    assert "not held" in run(app, "skip-group-head", "order:2").stdout
    run(app, "skip-group-head", "bad key", code=2)
