"""Admission and release on real Postgres: one test per guard clause of the ledger."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict, WrongState, groups_register
from celery_keyed.ledger.claims import HeldClaim


def arrive(ledger: Ledger, task_id: str, key: str = "acct:1", *, now=None, **kw) -> object:
    return ledger.admit(Arrival(task_id=task_id, key=key, message={"id": task_id}, **kw), now=now)


def test_unconfigured_name_is_a_mutex(ledger: Ledger) -> None:
    assert arrive(ledger, "a").verdict is Verdict.ADMITTED
    assert arrive(ledger, "b").verdict is Verdict.PARKED
    assert arrive(ledger, "c", key="acct:2").verdict is Verdict.ADMITTED  # other keys run in parallel


def test_claim_guard_used_below_limit(ledger: Ledger, scalar) -> None:
    ledger.configure({"gate": NameConfig("gate", limit=2)})
    verdicts = [arrive(ledger, f"t{i}", "gate:x").verdict for i in range(4)]
    assert verdicts == [Verdict.ADMITTED, Verdict.ADMITTED, Verdict.PARKED, Verdict.PARKED]
    assert scalar("SELECT sum(used) FROM keyed_slots WHERE key = 'gate:x'") == 2
    assert scalar("SELECT waiting FROM keyed_keys WHERE key = 'gate:x'") == 2


def test_used_cannot_go_negative(ledger: Ledger, engine: sa.Engine) -> None:
    arrive(ledger, "a")
    with pytest.raises(sa.exc.IntegrityError, match="keyed_slots_used_nonnegative"), engine.begin() as conn:
        conn.execute(sa.text("UPDATE keyed_slots SET used = used - 2"))
    with pytest.raises(WrongState, match=r"release without a claim \(bug\) \(keyed_slots_used_nonnegative\)"):
        ledger.transaction(lambda conn: conn.execute(sa.text("UPDATE keyed_slots SET used = used - 2")))


def test_registering_a_task_twice_in_a_group_is_wrong_state(ledger: Ledger, engine: sa.Engine) -> None:
    with engine.begin() as conn:
        assert groups_register(conn, "order:1", "t1") == 1
    with pytest.raises(WrongState, match="keyed_group_members_task_once"), engine.begin() as conn:
        groups_register(conn, "order:1", "t1")
    with engine.begin() as conn:  # the rolled-back attempt took no number
        assert groups_register(conn, "order:1", "t2") == 2


def test_release_is_fenced_and_idempotent(ledger: Ledger, scalar) -> None:
    a = arrive(ledger, "a")
    arrive(ledger, "b")
    assert not ledger.release(Token("a", 0), a.fence + 1000, Outcome.COMPLETED).released  # wrong fence
    assert not ledger.release(Token("a", 1), a.fence, Outcome.COMPLETED).released  # wrong attempt
    assert scalar("SELECT used FROM keyed_slots WHERE key = 'acct:1'") == 1
    first = ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED)
    assert first.released and [p.task_id for p in first.promotions] == ["b"]
    second = ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED)
    assert not second.released and second.promotions == []
    assert scalar("SELECT used FROM keyed_slots WHERE key = 'acct:1'") == 1  # b's promoted claim
    assert ledger.books()["completed"] == 1


def test_promotion_is_bound_once_by_its_nonce(ledger: Ledger) -> None:
    a = arrive(ledger, "a")
    arrive(ledger, "b")
    (p,) = ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED).promotions
    assert ledger.bind(p.token, uuid.uuid4()) is None  # forged nonce
    assert ledger.bind(Token("b", 1), p.nonce) is None  # right nonce, wrong attempt
    fence = ledger.bind(p.token, p.nonce)
    assert fence == p.fence
    assert ledger.bind(p.token, p.nonce) is None  # copied token after binding
    assert ledger.release(p.token, fence, Outcome.COMPLETED).released


def test_forged_admission_token_gets_ordinary_admission(ledger: Ledger) -> None:
    """A message carrying a nonce that the ledger never issued is admitted like any arrival (D5)."""
    assert ledger.bind(Token("x", 0), uuid.uuid4()) is None
    assert arrive(ledger, "x").verdict is Verdict.ADMITTED
    assert ledger.bind(Token("y", 0), uuid.uuid4()) is None
    assert arrive(ledger, "y").verdict is Verdict.PARKED


def test_waiting_room_bound_rejects_and_records(ledger: Ledger) -> None:
    ledger.configure({"r": NameConfig("r", limit=1, max_waiting=1)})
    assert [arrive(ledger, t, "r:1").verdict for t in "abc"] == [
        Verdict.ADMITTED,
        Verdict.PARKED,
        Verdict.REJECTED,
    ]
    assert ledger.explain("c").state == "finished"
    assert ledger.books() == {"open": 2, "rejected": 1, "arrivals": 3}


def test_max_waiting_zero_rejects_when_busy(ledger: Ledger) -> None:
    ledger.configure({"r": NameConfig("r", limit=1, max_waiting=0)})
    assert arrive(ledger, "a", "r:1").verdict is Verdict.ADMITTED
    assert arrive(ledger, "b", "r:1").verdict is Verdict.REJECTED


def test_expired_on_arrival(ledger: Ledger, clock) -> None:
    adm = arrive(ledger, "a", now=clock(), deadline=clock() - timedelta(seconds=1))
    assert adm.verdict is Verdict.EXPIRED
    assert ledger.books()["expired"] == 1


def test_max_wait_expires_waiter_and_expiry_is_rechecked_at_promotion(ledger: Ledger, clock) -> None:
    ledger.configure({"r": NameConfig("r", limit=1, max_wait=5.0)}, now=clock())
    a = arrive(ledger, "a", "r:1", now=clock())
    arrive(ledger, "b", "r:1", now=clock())
    # b's latest start passes, and a releases before any sweep ran: b must not be promoted.
    clock.advance(6)
    report = ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED, now=clock())
    assert report.promotions == []
    swept = ledger.sweep(now=clock())
    assert swept.finished == [("b", "expired")]
    assert ledger.books() == {"completed": 1, "expired": 1, "arrivals": 2}


def test_fifo_by_priority_then_arrival(ledger: Ledger) -> None:
    a = arrive(ledger, "a")
    arrive(ledger, "b")
    arrive(ledger, "c", priority=5)
    arrive(ledger, "d")
    order = []
    token, fence = Token("a", 0), a.fence
    for _ in range(3):
        (p,) = ledger.release(token, fence, Outcome.COMPLETED).promotions
        order.append(p.task_id)
        token, fence = p.token, ledger.bind(p.token, p.nonce)
    assert order == ["c", "b", "d"]


def test_retry_frees_the_key_for_another_task(ledger: Ledger) -> None:
    """DESIGN §3.5: for a concurrency key the slot is released during backoff."""
    a = arrive(ledger, "a")
    arrive(ledger, "b")
    (p,) = ledger.release(Token("a", 0), a.fence, Outcome.RETRY).promotions
    assert p.task_id == "b"
    assert ledger.books()["open"] == 2  # a is not finished: its retry comes back
    assert arrive(ledger, "a", attempt=1).verdict is Verdict.PARKED  # re-enters admission
    assert arrive(ledger, "a", attempt=0).verdict is Verdict.DUPLICATE  # the old attempt is over


def test_sharded_gate_draws_from_shares_and_credits_its_shard(ledger: Ledger, scalar) -> None:
    ledger.configure({"api": NameConfig("api", limit=3, shards=2)})
    adms = [arrive(ledger, f"t{i}", "api:x") for i in range(4)]
    assert [a.verdict for a in adms] == [Verdict.ADMITTED] * 3 + [Verdict.PARKED]
    assert sorted(a.shard for a in adms[:3]) == [0, 0, 1]  # shares 2 + 1 = 3
    victim = next(a for a in adms[:3] if a.shard == 1)
    idx = adms.index(victim)
    (p,) = ledger.release(Token(f"t{idx}", 0), victim.fence, Outcome.COMPLETED).promotions
    assert p.task_id == "t3"
    assert scalar("SELECT used FROM keyed_slots WHERE key = 'api:x' AND shard = 1") == 1
    assert scalar("SELECT used FROM keyed_slots WHERE key = 'api:x' AND shard = 0") == 2


def test_renew_only_the_tracked_attempts_of_this_holder(engine: sa.Engine, clock) -> None:
    mine = Ledger(engine, holder="h:1:new", lease=30)
    other = Ledger(engine, holder="h:1:old", lease=30)  # a dead predecessor with the same hostname and pid
    a = mine.admit(Arrival("a", key="k:1"), now=clock())
    b = other.admit(Arrival("b", key="k:2"), now=clock())
    held = {HeldClaim("a", 0, a.fence), HeldClaim("b", 0, b.fence)}
    assert mine.renew(held, now=clock.advance(20)) == {HeldClaim("a", 0, a.fence)}
    clock.advance(20)  # 40 s after b's claim, 20 s after a's renewal
    report = mine.reconcile(now=clock())
    assert report.reclaimed == [Token("b", 0)]


def test_reclaim_needs_an_expired_lease(ledger: Ledger, clock) -> None:
    arrive(ledger, "a", now=clock())
    assert ledger.reconcile(now=clock.advance(29)).reclaimed == []
    assert ledger.reconcile(now=clock.advance(2)).reclaimed == [Token("a", 0)]


def test_no_reclaim_until_the_server_was_up_a_full_lease(engine: sa.Engine, scalar) -> None:
    """D7: after a Postgres restart, leases that lapsed during the outage are not reclaimed at once."""
    started = scalar("SELECT pg_postmaster_start_time()")
    ledger = Ledger(engine, lease=30)
    ledger.admit(Arrival("a", key="k:1"), now=started - timedelta(seconds=60))  # lease lapsed in the outage
    assert ledger.reconcile(now=started + timedelta(seconds=10)).reclaimed == []  # up 10 s < lease 30 s
    assert ledger.reconcile(now=started + timedelta(seconds=31)).reclaimed == [Token("a", 0)]


def test_stale_holder_after_reclaim_is_fenced(ledger: Ledger, clock, scalar) -> None:
    old = arrive(ledger, "a", now=clock())
    clock.advance(31)
    assert ledger.reconcile(now=clock()).reclaimed == [Token("a", 0)]
    new = arrive(ledger, "a", now=clock())  # the broker redelivers the same attempt (acks_late)
    assert new.verdict is Verdict.ADMITTED and new.fence > old.fence
    stale = ledger.release(Token("a", 0), old.fence, Outcome.COMPLETED, now=clock())
    assert not stale.released
    assert ledger.explain("a", now=clock()).state == "running"
    assert scalar("SELECT used FROM keyed_slots WHERE key = 'acct:1'") == 1
    assert ledger.renew([HeldClaim("a", 0, old.fence)], now=clock()) == set()


def test_duplicates_by_attempt_token(ledger: Ledger) -> None:
    """D8: parked or promoted → duplicate; live claim → shadow; finished → dropped."""
    a = arrive(ledger, "a")
    arrive(ledger, "b")
    assert arrive(ledger, "b").verdict is Verdict.DUPLICATE  # parked
    dup = arrive(ledger, "a")
    assert dup.verdict is Verdict.DUPLICATE and "shadow" in dup.detail
    assert ledger.explain("a").state == "running"
    (p,) = ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED).promotions  # shadow dropped with it
    assert p.task_id == "b"
    assert arrive(ledger, "b").verdict is Verdict.DUPLICATE  # promoted
    assert arrive(ledger, "a").verdict is Verdict.DUPLICATE  # finished
    fence = ledger.bind(p.token, p.nonce)
    assert ledger.release(p.token, fence, Outcome.COMPLETED).promotions == []


def test_shadow_of_lost_attempt_runs(ledger: Ledger, clock) -> None:
    arrive(ledger, "a", now=clock())
    assert "shadow" in arrive(ledger, "a", now=clock()).detail
    report = ledger.reconcile(now=clock.advance(31))
    assert report.reclaimed == [Token("a", 0)]
    assert [p.task_id for p in report.promotions] == ["a"]


def test_supersede_policy(ledger: Ledger) -> None:
    ledger.configure({"s": NameConfig("s", limit=1, max_waiting=2, overflow="supersede")})
    arrive(ledger, "run", "s:1")
    arrive(ledger, "old", "s:1", supersede_key="report-7")
    arrive(ledger, "other", "s:1")
    new = arrive(ledger, "new", "s:1", supersede_key="report-7")
    assert new.verdict is Verdict.PARKED and new.superseded == ("old",)
    full = arrive(ledger, "newest", "s:1")  # room full: the oldest parked attempt is replaced
    assert full.verdict is Verdict.PARKED and full.superseded == ("other",)
    books = ledger.books()
    assert books["superseded"] == 2 and books["arrivals"] == 5


def test_revoke_parked_and_unseen(ledger: Ledger) -> None:
    arrive(ledger, "a")
    arrive(ledger, "b")
    ledger.revoke("b")
    assert ledger.explain("b").text.startswith("finished: revoked")
    ledger.revoke("c")  # not seen yet: stored so the arrival is dropped
    assert arrive(ledger, "c").verdict is Verdict.DUPLICATE
    assert ledger.books()["revoked"] == 2


def test_not_before_waits_for_the_sweep(ledger: Ledger, clock) -> None:
    adm = arrive(ledger, "a", now=clock(), not_before=clock() + timedelta(seconds=10))
    assert adm.verdict is Verdict.PARKED
    assert ledger.explain("a", now=clock()).state == "not_before"
    assert ledger.sweep(now=clock.advance(5)).promotions == []
    assert [p.task_id for p in ledger.sweep(now=clock.advance(6)).promotions] == ["a"]


def test_explain_says_why(ledger: Ledger) -> None:
    ledger.configure({"gate": NameConfig("gate", limit=2)})
    for t in "abcd":
        arrive(ledger, t, "gate:x")
    assert ledger.explain("d").text == "waiting behind 1 others for key gate:x (in flight 2/2)"
    assert ledger.explain("zzz").state == "unknown"
    ledger.set_override("gate", 0, reason="incident")
    assert ledger.explain("c").state == "paused"


def test_idle_keys_are_dropped_and_recreated(ledger: Ledger, clock, scalar) -> None:
    a = arrive(ledger, "a", now=clock())
    arrive(ledger, "b", now=clock())
    (p,) = ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED, now=clock()).promotions
    ledger.release(p.token, ledger.bind(p.token, p.nonce, now=clock()), Outcome.COMPLETED, now=clock())
    assert ledger.reconcile(now=clock.advance(7200)).dropped_keys == 1
    assert scalar("SELECT count(*) FROM keyed_slots") == 0
    assert arrive(ledger, "c", now=clock()).verdict is Verdict.ADMITTED


def test_a_promoted_run_that_is_lost_goes_back_in_line(ledger: Ledger, clock, scalar) -> None:
    """A promoted attempt runs from the message stored when it was parked (that broker message was acked). If
    that run is lost — its worker dies and the lease is reclaimed, or it is released as worker-lost — the
    attempt must not be lost: it goes back in line from the stored message, and runs again."""
    a = arrive(ledger, "a", now=clock())
    arrive(ledger, "b", now=clock())
    arrive(ledger, "c", now=clock())
    (p,) = ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED, now=clock()).promotions
    assert p.task_id == "b" and ledger.bind(p.token, p.nonce, now=clock()) is not None
    report = ledger.reconcile(now=clock.advance(31))  # b's worker died mid-run
    assert report.reclaimed == [Token("b", 0)]
    assert [q.task_id for q in report.promotions] == ["b"]  # back in its old place, ahead of c
    assert arrive(ledger, "b", now=clock()).verdict is Verdict.DUPLICATE  # a broker copy is a duplicate
    (q,) = report.promotions
    fence = ledger.bind(q.token, q.nonce, now=clock())
    (r,) = ledger.release(q.token, fence, Outcome.WORKER_LOST, now=clock()).promotions  # lost again
    assert r.task_id == "b"
    fence = ledger.bind(r.token, r.nonce, now=clock())
    (s,) = ledger.release(r.token, fence, Outcome.COMPLETED, now=clock()).promotions
    assert s.task_id == "c"
    assert scalar("SELECT waiting FROM keyed_keys WHERE key = 'acct:1'") == 0
    assert ledger.books() == {"completed": 2, "open": 1, "arrivals": 3}


def test_a_releaser_that_runs_the_next_attempt_itself_gets_it_bound(ledger: Ledger, clock, scalar) -> None:
    """D4 without a bind round trip: the promotion of a task the releaser has, from a queue it consumes, is a
    running claim of the releaser at once; other promotions still carry a nonce (D5)."""
    msg = {"task": "proj.sync"}
    a = arrive(ledger, "a", now=clock())
    ledger.admit(Arrival("b", key="acct:1", queue="celery", message=msg), now=clock())
    ledger.admit(Arrival("c", key="acct:1", queue="other", message=msg), now=clock())
    report = ledger.release(
        Token("a", 0), a.fence, Outcome.COMPLETED, local_queues=["celery"], local_tasks=["proj.sync"], now=clock()
    )
    (p,) = report.promotions
    assert p.task_id == "b" and p.nonce is None
    assert scalar("SELECT state || ' ' || holder FROM keyed_claims WHERE task_id = 'b'") == f"running {ledger.holder}"
    assert ledger.renew([HeldClaim("b", 0, p.fence)], now=clock()) == {HeldClaim("b", 0, p.fence)}
    (q,) = ledger.release(
        p.token, p.fence, Outcome.COMPLETED, local_queues=["celery"], local_tasks=["proj.sync"], now=clock()
    ).promotions
    assert q.task_id == "c" and q.nonce is not None  # not a queue this releaser consumes: republished (D5)


def test_the_sweep_settles_a_shadow_whose_claim_is_gone(ledger: Ledger, engine: sa.Engine, scalar) -> None:
    """A duplicate parked as a shadow while its attempt's release was committing (the race D8's lock on the
    task row closes for the general path) is settled by the sweep: made live if the attempt may come back,
    dropped if it is over."""
    arrive(ledger, "a")
    assert "shadow" in arrive(ledger, "a").detail
    arrive(ledger, "b", key="acct:2")
    assert "shadow" in arrive(ledger, "b", key="acct:2").detail
    with engine.begin() as conn:  # both claims vanished without taking their shadows along
        conn.execute(sa.text("DELETE FROM keyed_claims"))
        conn.execute(sa.text("UPDATE keyed_slots SET used = 0"))
        conn.execute(sa.text("UPDATE keyed_tasks SET outcome = 'completed', finished_at = now() WHERE task_id = 'b'"))
    report = ledger.sweep()
    assert [p.task_id for p in report.promotions] == ["a"]  # a's run was lost: its copy runs
    assert scalar("SELECT count(*) FROM keyed_waiting") == 0
    assert scalar("SELECT waiting FROM keyed_keys WHERE key = 'acct:2'") == 0  # b was over: dropped


def test_revoke_takes_back_an_unbound_promotion(ledger: Ledger, scalar) -> None:
    a = arrive(ledger, "a")
    arrive(ledger, "b")
    arrive(ledger, "c")
    (p,) = ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED).promotions
    assert p.task_id == "b"
    promotions = ledger.revoke("b")  # b was republished but nobody bound it yet
    assert [q.task_id for q in promotions] == ["c"]  # its slot goes to the next waiter
    assert ledger.bind(p.token, p.nonce) is None  # the copy in flight can no longer take it
    assert arrive(ledger, "b").verdict is Verdict.DUPLICATE  # ... and is dropped when it arrives
    assert ledger.books()["revoked"] == 1


def test_revoke_between_attempts_books_the_task_revoked(ledger: Ledger) -> None:
    a = arrive(ledger, "a")
    assert ledger.release(Token("a", 0), a.fence, Outcome.RETRY).released  # a retry is in transit
    assert ledger.revoke("a") == []
    assert ledger.books()["revoked"] == 1
    assert ledger.admit(Arrival(task_id="a", attempt=1, key="acct:1", message={})).verdict is Verdict.DUPLICATE


def test_revoke_leaves_a_running_attempt_to_its_worker(ledger: Ledger) -> None:
    a = arrive(ledger, "a")
    assert ledger.revoke("a") == []
    assert ledger.books().get("open") == 1
    assert ledger.release(Token("a", 0), a.fence, Outcome.REVOKED).finished == [("a", "revoked")]
