"""``celery keyed set-weight`` / ``clear-weight`` / ``weights`` and the fair shares of ``status`` on a real ledger
(weighted fair sharing, issue 14 item 5): writes are checked in the ledger's own tables (overrides, audit rows)."""

from __future__ import annotations

from celery import Celery

from celery_keyed.ledger import Arrival, Ledger, NameConfig
from tests.integration.test_cli import app, run, run_json

__all__ = ["app"]  # the fixture, shared with test_cli


def test_set_weight_clear_weight_and_weights(app: Celery, ledger: Ledger, engine) -> None:
    app.conf.keyed_concurrency_limits = {"crm": {"limit": 4, "fair": True}}
    app.conf.keyed_fair_weights = {"crm": {"tenant": 2}}
    out = run_json(app, "set-weight", "crm", "tenant:big", "3", "--reason", "big plan", "--expires-in", "600")
    assert out["name"] == "crm" and out["prefix"] == "tenant:big" and out["weight"] == 3.0 and out["fair_name"]
    listed = run_json(app, "weights")
    assert listed["configured"] == {"crm": {"tenant": 2.0}}
    assert [(o["prefix"], o["weight"], o["reason"]) for o in listed["overrides"]] == [("tenant:big", 3.0, "big plan")]
    text = run(app, "weights").stdout
    assert "tenant:big" in text and "override" in text and "config" in text
    assert "weigh 3" in run(app, "set-weight", "crm", "tenant:big", "3", "--reason", "again").stdout
    assert run_json(app, "clear-weight", "crm", "tenant:big", "--reason", "done")["cleared"] is True
    assert "no fair weight override" in run(app, "clear-weight", "crm", "tenant:big").stdout
    with engine.connect() as conn:
        log = [tuple(r) for r in conn.exec_driver_sql(
            "SELECT prefix, action, new_weight, reason FROM keyed_fair_weight_log ORDER BY id")]
    assert log == [
        ("tenant:big", "set", 3.0, "big plan"),
        ("tenant:big", "set", 3.0, "again"),
        ("tenant:big", "clear", None, "done"),
    ]


def test_bad_weights_are_usage_errors_and_change_nothing(app: Celery, engine) -> None:
    for args in (["crm", "t", "0"], ["crm", "t", "-1"], ["crm", "t", "x"], ["crm", "t", "2e9"], ["crm", "", "2"],
                 ["bad:name", "t", "2"]):
        run(app, "set-weight", *args, "--reason", "r", code=2)
    run(app, "set-weight", "crm", "t", "2", "--reason", " ", code=2)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM keyed_fair_weight_overrides").scalar() == 0


def test_status_shows_the_fair_shares(app: Celery, ledger: Ledger) -> None:
    ledger.configure({"crm": NameConfig("crm", limit=2, fair=True, fair_weights={"tenant:big": 3})})
    for i in range(3):
        ledger.admit(Arrival(f"big{i}", key="crm:eu", fair_key="tenant:big", message={"id": f"big{i}"}))
    ledger.admit(Arrival("small0", key="crm:eu", fair_key="tenant:small", message={"id": "small0"}))
    shares = {s["fair_key"]: s for s in run_json(app, "status")["fair_shares"]}
    assert (shares["tenant:big"]["holding"], shares["tenant:big"]["waiting"], shares["tenant:big"]["weight"]) == (
        2, 1, 3.0)
    assert (shares["tenant:small"]["holding"], shares["tenant:small"]["waiting"]) == (0, 1)
    text = run(app, "status").stdout
    assert "fair shares" in text and "tenant:small" in text
