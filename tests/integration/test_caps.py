"""Caps and borrowing on real Postgres: a name's cap bounds all its keys together, exactly (every task of a key of
the name also holds a slot of the cap key); a borrowing name's key runs past its own limit, up to the cap, while no
task waits for the cap, and takes no more past its limit once one does; the slots come back to the others first."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import Arrival, InvalidConfig, Ledger, NameConfig, Outcome, Token, Verdict
from celery_keyed.ledger.bounds import EXCLUSIVE_COST
from celery_keyed.ledger.reconcile import check_counters_once
from celery_keyed.ledger.status import status_names


def arrive(ledger: Ledger, task_id: str, key: str, *, cost: int = 1, now=None):
    return ledger.admit(Arrival(task_id=task_id, key=key, cost=cost, message={"id": task_id}), now=now)


def used(scalar: Callable[..., object], key: str) -> int:
    return int(scalar("SELECT COALESCE(sum(used), 0) FROM keyed_slots WHERE key = :key", key=key) or 0)


def name_total(scalar: Callable[..., object], name: str) -> int:
    """What the keys of ``name`` hold together, counted from their own rows (not from the cap's)."""
    return int(scalar("SELECT COALESCE(sum(used), 0) FROM keyed_slots WHERE name = :name", name=name) or 0)


def test_a_cap_bounds_the_keys_of_a_name_together(ledger: Ledger, scalar) -> None:
    ledger.configure({"tenant": NameConfig("tenant", limit=2, cap=3)})
    a1, a2 = arrive(ledger, "a1", "tenant:a"), arrive(ledger, "a2", "tenant:a")
    assert a1.admitted and a2.admitted
    assert arrive(ledger, "a3", "tenant:a").verdict is Verdict.PARKED  # its own limit
    b1 = arrive(ledger, "b1", "tenant:b")
    assert b1.admitted
    b2 = arrive(ledger, "b2", "tenant:b")
    assert b2.verdict is Verdict.PARKED  # tenant:b has room, the name's cap (3) does not
    assert scalar("SELECT key FROM keyed_waiting WHERE task_id = 'b2'") == "tenant#cap"
    text = ledger.explain("b2").text
    assert "waiting for the cap of tenant: its keys hold 3 of 3 together" in text and "tenant:b" in text, text
    assert name_total(scalar, "tenant") == 3 and used(scalar, "tenant#cap") == 3
    report = ledger.release(Token("b1", 0), b1.fence, Outcome.COMPLETED)
    assert len(report.promotions) == 1  # one slot of the cap came back: one task starts
    assert name_total(scalar, "tenant") == 3 and used(scalar, "tenant#cap") == 3
    assert check_counters_once(ledger.engine) == []


def test_a_borrowing_key_runs_up_to_the_cap_while_nobody_waits_for_it(ledger: Ledger, clock, scalar) -> None:
    ledger.configure({"tenant": NameConfig("tenant", limit=1, cap=4, borrow=True)}, now=clock())
    fences = {}
    for i in range(5):
        admission = arrive(ledger, f"a{i}", "tenant:a", now=clock())
        if admission.admitted:
            fences[f"a{i}"] = admission.fence
    assert sorted(fences) == ["a0", "a1", "a2", "a3"]  # 4 at once on a key of limit 1: the name's idle room
    assert scalar("SELECT key FROM keyed_waiting WHERE task_id = 'a4'") == "tenant:a"
    # another key's task waits for the cap: tenant:a takes no more past its own limit
    assert arrive(ledger, "b0", "tenant:b", now=clock()).verdict is Verdict.PARKED
    assert scalar("SELECT key FROM keyed_waiting WHERE task_id = 'b0'") == "tenant#cap"
    report = ledger.release(Token("a0", 0), fences.pop("a0"), Outcome.COMPLETED, now=clock())
    assert [p.task_id for p in report.promotions] == ["b0"]  # the cap's slot goes to the waiting key, not to a4
    assert used(scalar, "tenant:a") == 3 and used(scalar, "tenant:b") == 1
    # nobody waits for the cap now: tenant:a borrows again as room comes back
    report = ledger.release(Token("a1", 0), fences.pop("a1"), Outcome.COMPLETED, now=clock())
    promoted = [p.task_id for p in report.promotions] + [
        p.task_id for p in ledger.sweep(now=clock.advance(1)).promotions
    ]
    assert promoted == ["a4"]
    assert used(scalar, "tenant:a") == 3 and name_total(scalar, "tenant") == 4
    assert check_counters_once(ledger.engine) == []


def test_a_new_arrival_of_a_borrowing_key_waits_behind_the_others_at_the_cap(ledger: Ledger, scalar) -> None:
    """Past its own limit a key's new task stands in its own line while another key's task waits for the cap."""
    ledger.configure({"tenant": NameConfig("tenant", limit=1, cap=2, borrow=True)})
    assert arrive(ledger, "a0", "tenant:a").admitted and arrive(ledger, "a1", "tenant:a").admitted
    assert arrive(ledger, "b0", "tenant:b").verdict is Verdict.PARKED  # waits for the cap
    assert arrive(ledger, "a2", "tenant:a").verdict is Verdict.PARKED
    assert scalar("SELECT key FROM keyed_waiting WHERE task_id = 'a2'") == "tenant:a"  # not ahead of b0 at the cap


def test_costs_count_against_the_cap(ledger: Ledger, scalar) -> None:
    ledger.configure({"tenant": NameConfig("tenant", limit=5, cap=4)})
    assert arrive(ledger, "a", "tenant:a", cost=3).admitted
    assert arrive(ledger, "b", "tenant:b", cost=2).verdict is Verdict.PARKED
    assert used(scalar, "tenant#cap") == 3
    heavy = arrive(ledger, "h", "tenant:c", cost=5)
    assert heavy.verdict is Verdict.REJECTED and "tenant#cap" in heavy.detail


def test_a_writer_on_a_capped_name_is_rejected_with_the_reason(ledger: Ledger) -> None:
    ledger.configure({"doc": NameConfig("doc", limit=3, cap=10)})
    writer = arrive(ledger, "w", "doc:1", cost=EXCLUSIVE_COST)
    assert writer.verdict is Verdict.REJECTED and "the name has a cap" in writer.detail


def test_raising_and_lifting_a_cap_start_the_tasks_it_held(ledger: Ledger, scalar) -> None:
    ledger.configure({"tenant": NameConfig("tenant", limit=1, cap=1)})
    assert arrive(ledger, "a", "tenant:a").admitted
    assert arrive(ledger, "b", "tenant:b").verdict is Verdict.PARKED
    assert arrive(ledger, "c", "tenant:c").verdict is Verdict.PARKED
    promotions = ledger.configure({"tenant": NameConfig("tenant", limit=1, cap=2)})
    assert [p.task_id for p in promotions] == ["b"]
    promotions = ledger.configure({"tenant": NameConfig("tenant", limit=1)})  # no cap any more
    assert [p.task_id for p in promotions] == ["c"]
    assert arrive(ledger, "d", "tenant:d").admitted  # takes no slot of the cap key
    assert used(scalar, "tenant#cap") == 3 and used(scalar, "tenant:d") == 1


def test_status_and_the_metrics_show_the_cap_and_what_the_name_holds(gauge, ledger: Ledger, engine: sa.Engine) -> None:
    ledger.configure({"tenant": NameConfig("tenant", limit=1, cap=5, borrow=True)})
    for i in range(3):
        arrive(ledger, f"a{i}", "tenant:a")
    with engine.connect() as conn:
        by_name = {n.name: n for n in status_names(conn)}
    assert (by_name["tenant"].cap, by_name["tenant"].borrow) == (5, True)
    assert by_name["tenant#cap"].limit == 5 and by_name["tenant#cap"].in_flight == 3
    assert gauge("celery_keyed_in_flight", name="tenant#cap") == 3
    assert gauge("celery_keyed_limit", name="tenant#cap", source="config") == 5


def test_a_task_revoked_while_it_waits_for_the_cap_leaves_its_line(ledger: Ledger, scalar) -> None:
    ledger.configure({"tenant": NameConfig("tenant", limit=1, cap=1)})
    a = arrive(ledger, "a", "tenant:a")
    assert arrive(ledger, "b", "tenant:b").verdict is Verdict.PARKED
    assert scalar("SELECT waiting FROM keyed_keys WHERE key = 'tenant#cap'") == 1
    ledger.revoke("b")
    assert scalar("SELECT waiting FROM keyed_keys WHERE key = 'tenant#cap'") == 0
    assert used(scalar, "tenant:b") == 0 and scalar("SELECT count(*) FROM keyed_waiting") == 0
    assert ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED).promotions == []
    assert used(scalar, "tenant#cap") == 0 and check_counters_once(ledger.engine) == []


def test_group_members_of_a_capped_name_run_in_order_and_count_against_the_cap(ledger: Ledger, scalar) -> None:
    ledger.configure({"tenant": NameConfig("tenant", limit=5, cap=2)})
    blocker = arrive(ledger, "x", "tenant:x")
    first = ledger.admit(Arrival("g1", key="tenant:g", group_key="order:1", group_seq=1, message={}))
    second = ledger.admit(Arrival("g2", key="tenant:g", group_key="order:1", group_seq=2, message={}))
    assert first.admitted and second.verdict is Verdict.PARKED  # its group's head runs
    assert arrive(ledger, "y", "tenant:y").verdict is Verdict.PARKED  # the cap (2) is full
    report = ledger.release(Token("g1", 0), first.fence, Outcome.COMPLETED)
    promoted = {p.task_id for p in report.promotions}
    assert len(promoted) == 1 and promoted <= {"g2", "y"}
    assert name_total(scalar, "tenant") == 2 and used(scalar, "tenant#cap") == 2
    _ = blocker


def test_a_sharded_name_keeps_its_cap_exact(ledger: Ledger, scalar) -> None:
    ledger.configure({"tenant": NameConfig("tenant", limit=4, shards=2, cap=3, borrow=True)})
    verdicts = [arrive(ledger, f"t{i}", f"tenant:{i % 2}").verdict for i in range(6)]
    assert verdicts.count(Verdict.ADMITTED) == 3
    assert name_total(scalar, "tenant") == 3 and used(scalar, "tenant#cap") == 3
    assert check_counters_once(ledger.engine) == []


@pytest.mark.parametrize(
    "options, message",
    [({"borrow": True}, "borrow needs a cap"), ({"cap": 0}, "at least 1"), ({"cap": 2, "borrow": "yes"}, "True or")],
)
def test_bad_caps_are_refused(options, message) -> None:
    with pytest.raises(InvalidConfig, match=message):
        NameConfig("tenant", **options)


def test_a_cap_another_worker_configured_applies_here_within_the_ttl(ledger: Ledger, engine: sa.Engine,
                                                                      scalar) -> None:
    from celery_keyed.ledger.caps import Caps

    other = Ledger(engine, holder="other-host:2:bbbb", lease=30.0, dispatch=10.0)
    other.caps = Caps(engine, ttl=0.2)
    assert arrive(other, "before", "tenant:a").admitted  # read now: no name has a cap
    ledger.configure({"tenant": NameConfig("tenant", limit=5, cap=1)})
    assert arrive(other, "cached", "tenant:b").admitted  # within the ttl: not counted against the cap yet
    assert used(scalar, "tenant#cap") == 0
    time.sleep(0.3)
    assert arrive(other, "after", "tenant:c").admitted and used(scalar, "tenant#cap") == 1  # read again: counted
    assert arrive(other, "next", "tenant:d").verdict is Verdict.PARKED  # the cap (1) is full
