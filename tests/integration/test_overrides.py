"""Runtime limits (§3.7) and no lost wakeups from overrides (§3.12)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import Arrival, InvalidConfig, Ledger, NameConfig, Outcome, Token, Verdict


def test_zero_pauses_and_clearing_resumes(ledger: Ledger, scalar) -> None:
    ledger.configure({"g": NameConfig("g", limit=2)})
    running = ledger.admit(Arrival("a", key="g:1"))
    assert ledger.set_override("g", 0, reason="incident 42", author="ops") == []
    assert ledger.admit(Arrival("b", key="g:1")).verdict is Verdict.PARKED
    assert ledger.admit(Arrival("c", key="g:2")).verdict is Verdict.PARKED
    assert ledger.release(Token("a", 0), running.fence, Outcome.COMPLETED).promotions == []  # still paused
    promoted = ledger.clear_override("g", reason="resolved", author="ops")
    assert sorted(p.task_id for p in promoted) == ["b", "c"]
    log = scalar(
        "SELECT string_agg(action || ':' || coalesce(new_limit::text, '-'), ',' ORDER BY id) FROM keyed_override_log"
    )
    assert log == "set:0,clear:-"


def test_raising_a_limit_promotes_at_once(ledger: Ledger) -> None:
    for t in "abc":
        ledger.admit(Arrival(t, key="m:1"))  # unconfigured: K = 1
    assert [p.task_id for p in ledger.set_override("m", 3, reason="more")] == ["b", "c"]


def test_override_expiry_lapses_by_itself(ledger: Ledger, clock) -> None:
    ledger.admit(Arrival("a", key="g:1"), now=clock())
    ledger.set_override("g", 0, reason="short pause", expires_at=clock() + timedelta(seconds=60), now=clock())
    running = ledger.admit(Arrival("b", key="g:1"), now=clock())
    assert running.verdict is Verdict.PARKED
    assert ledger.sweep(now=clock.advance(30)).promotions == []
    # expiry is also read by the claim itself: no timer needed for correctness
    assert ledger.admit(Arrival("c", key="g:2"), now=clock.advance(31)).admitted
    assert ledger.sweep(now=clock()).promotions == []  # g:1 is held by a (K = 1)


def test_override_validation(ledger: Ledger) -> None:
    with pytest.raises(InvalidConfig, match="non-negative integer"):
        ledger.set_override("g", -1, reason="x")
    with pytest.raises(InvalidConfig, match="non-negative integer"):
        ledger.set_override("g", 1.5, reason="x")  # type: ignore[arg-type]
    with pytest.raises(InvalidConfig, match="needs a reason"):
        ledger.set_override("g", 1, reason="  ")


def test_check_constraints_back_the_validation(engine: sa.Engine) -> None:
    with pytest.raises(sa.exc.IntegrityError, match="keyed_overrides_limit_nonnegative"), engine.begin() as c:
        c.execute(
            sa.text("INSERT INTO keyed_overrides (name, slot_limit, reason, set_at) VALUES ('g', -1, 'x', now())")
        )
    with pytest.raises(sa.exc.IntegrityError, match="keyed_overrides_reason_present"), engine.begin() as c:
        c.execute(sa.text("INSERT INTO keyed_overrides (name, slot_limit, reason, set_at) VALUES ('g', 1, ' ', now())"))


def test_a_broken_configuration_rule_is_a_domain_error(ledger: Ledger) -> None:
    """errors.translate: a named CHECK violated inside a ledger transaction raises InvalidConfig naming the rule
    and the constraint (the database's error is its cause), not a raw IntegrityError."""
    insert = sa.text("INSERT INTO keyed_overrides (name, slot_limit, reason, set_at) VALUES ('g', -1, 'x', now())")
    with pytest.raises(InvalidConfig, match=r"non-negative integer \(0 pauses\) \(keyed_overrides_limit_nonnegative\)"):
        ledger.transaction(lambda conn: conn.execute(insert))
    bad_rate = sa.text("INSERT INTO keyed_names (name, slot_limit, rate, updated_at) VALUES ('r', 1, -1, now())")
    with pytest.raises(InvalidConfig, match="keyed_names_rate_positive") as caught:
        ledger.transaction(lambda conn: conn.execute(bad_rate))
    assert isinstance(caught.value.__cause__, sa.exc.IntegrityError)


def test_sweep_is_the_backstop_for_any_missed_wakeup(ledger: Ledger, engine: sa.Engine) -> None:
    """Whatever made room — here a slot freed behind the ledger's back — the sweep promotes (§3.12)."""
    ledger.admit(Arrival("a", key="k:1"))
    ledger.admit(Arrival("b", key="k:1"))
    with engine.begin() as conn:  # simulate a lost wakeup: the claim vanished without a promotion
        conn.execute(sa.text("DELETE FROM keyed_claims WHERE task_id = 'a'"))
        conn.execute(sa.text("UPDATE keyed_slots SET used = 0"))
    assert [p.task_id for p in ledger.sweep().promotions] == ["b"]


def test_reconcile_reports_and_repairs_drift(ledger: Ledger, engine: sa.Engine, scalar) -> None:
    ledger.admit(Arrival("a", key="k:1"))
    ledger.admit(Arrival("b", key="k:1"))
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE keyed_slots SET used = 1 WHERE key = 'k:1'"))  # consistent
        conn.execute(sa.text("UPDATE keyed_keys SET waiting = 5 WHERE key = 'k:1'"))  # drift
    report = ledger.reconcile()
    assert report.drift == ["k:1: waiting 5 but 1 parked rows exist"]
    assert scalar("SELECT waiting FROM keyed_keys WHERE key = 'k:1'") == 1
    assert scalar("SELECT count(*) FROM keyed_events WHERE kind = 'drift'") == 1
    assert ledger.reconcile().drift == []


def test_changing_an_override_logs_the_old_limit(ledger: Ledger, scalar) -> None:
    ledger.set_override("stripe", 3, reason="first")
    ledger.set_override("stripe", 5, reason="second")
    rows = scalar("SELECT string_agg(coalesce(old_limit::text, '-') || '>' || new_limit, ',' ORDER BY id)"
                  " FROM keyed_override_log")
    assert rows == "->3,3>5"
