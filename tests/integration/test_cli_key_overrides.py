"""``celery keyed pause-key`` / ``resume-key`` / ``set-key-limit`` / ``clear-key-limit`` and the key overrides in
``status`` and ``explain`` (issue 14 item 4), on a real ledger; writes are checked in the ledger's own tables."""

from __future__ import annotations

from celery import Celery

from celery_keyed.ledger import Arrival, Ledger, Verdict
from tests.integration.test_cli import app, park, run, run_json

__all__ = ["app"]


def test_pause_and_resume_a_key_from_the_cli(app: Celery, engine, scalar) -> None:
    ledger = Ledger(engine)
    paused = run_json(app, "pause-key", "api:7", "--for", "300", "--reason", "vendor incident", "--author", "ops")
    assert paused["changed"] is True and paused["key"] == "api:7"
    assert park(ledger, "t1", "api:7") is Verdict.PARKED  # api is configured 3: only the key's pause stops it
    assert ledger.admit(Arrival("t2", key="api:8")).admitted
    again = run_json(app, "pause-key", "api:7", "--for", "10", "--reason", "shorter")
    assert again["changed"] is False  # a pause is only ever extended
    status = run_json(app, "status")
    (own,) = status["key_overrides"]
    assert own["key"] == "api:7" and own["paused"] is True and own["pause_reason"] == "vendor incident"
    assert {n["name"]: n["paused_keys"] for n in status["names"]}["api"] == 1
    text = run(app, "status").stdout
    assert "key overrides" in text and "vendor incident (ops)" in text and "1 key paused" in text
    explained = run_json(app, "explain", "t1")
    assert explained["state"] == "paused" and "paused until" in explained["text"]
    resumed = run_json(app, "resume-key", "api:7", "--reason", "over", "--author", "ops")
    assert resumed == {"key": "api:7", "resumed": True, "promoted": 1}
    assert run_json(app, "resume-key", "api:7")["resumed"] is False
    actions = scalar("SELECT string_agg(action, ',' ORDER BY id) FROM keyed_override_log WHERE key = 'api:7'")
    assert actions == "pause,resume"


def test_set_and_clear_a_key_limit_from_the_cli(app: Celery, engine, scalar) -> None:
    out = run_json(app, "set-key-limit", "api:big", "5", "--reason", "enterprise", "--expires-in", "3600")
    assert out["limit"] == 5 and out["effective_limit"] == 5 and out["expires_at"] is not None
    assert scalar("SELECT slot_limit FROM keyed_key_overrides WHERE key = 'api:big'") == 5
    assert "own limit 5" in run(app, "set-key-limit", "api:big", "5", "--reason", "enterprise").stdout
    assert run_json(app, "clear-key-limit", "api:big", "--reason", "done")["cleared"] is True
    assert run_json(app, "clear-key-limit", "api:big")["cleared"] is False
    assert scalar("SELECT count(*) FROM keyed_key_overrides") == 0


def test_bad_input_changes_nothing(app: Celery, scalar) -> None:
    run(app, "pause-key", "bad key", "--for", "5", "--reason", "x", code=2)
    run(app, "pause-key", "api:1", "--reason", "x", code=2)  # neither --for nor --until
    run(app, "pause-key", "api:1", "--for", "5", "--reason", " ", code=2)
    run(app, "pause-key", "api:1", "--until", "2001-01-01T00:00:00", "--reason", "x", code=2)
    run(app, "set-key-limit", "api:1", "-1", "--reason", "x", code=2)
    assert scalar("SELECT count(*) FROM keyed_key_overrides") == 0
