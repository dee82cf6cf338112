"""Composition on real Postgres (DESIGN §3.10, issue 4): several keys per attempt claimed all-or-nothing,
strict FIFO per key (a multi-key or heavy attempt is never starved), weighted slots, uncertain holds."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from datetime import timedelta

import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict
from celery_keyed.ledger.promote import promote_multi
from celery_keyed.ledger.reconcile import check_counters_once, promote_all


def arrive(ledger: Ledger, task_id: str, *keys: str, cost: int = 1, now=None, **kw):
    return ledger.admit(
        Arrival(task_id=task_id, key=keys[0], extra_keys=tuple(keys[1:]), cost=cost, message={"id": task_id}, **kw),
        now=now,
    )


def used(scalar: Callable[..., object], key: str) -> int:
    return int(scalar("SELECT COALESCE(sum(used), 0) FROM keyed_slots WHERE key = :key", key=key) or 0)


def finish(ledger: Ledger, task_id: str, fence: int, outcome: Outcome = Outcome.COMPLETED, **kw):
    return ledger.release(Token(task_id, 0), fence, outcome, **kw)


def test_several_keys_are_claimed_all_or_nothing(ledger: Ledger, scalar) -> None:
    ledger.configure({"tenant": NameConfig("tenant", limit=2), "stripe": NameConfig("stripe", limit=3)})
    a = arrive(ledger, "a", "tenant:1", "stripe")
    b = arrive(ledger, "b", "tenant:1", "stripe")
    c = arrive(ledger, "c", "tenant:2", "stripe")
    assert [x.verdict for x in (a, b, c)] == [Verdict.ADMITTED] * 3
    assert used(scalar, "tenant:1") == 2 and used(scalar, "tenant:2") == 1 and used(scalar, "stripe") == 3
    # stripe is full: tenant:3 has room but takes nothing (no partial hold)
    d = arrive(ledger, "d", "tenant:3", "stripe")
    assert d.verdict is Verdict.PARKED
    assert used(scalar, "tenant:3") == 0 and used(scalar, "stripe") == 3
    # tenant:1 is full: stripe keeps its count
    assert arrive(ledger, "e", "tenant:1", "stripe").verdict is Verdict.PARKED
    # releasing c frees both of its keys at once and promotes d (oldest waiter that fits): it holds both
    report = finish(ledger, "c", c.fence)
    assert [p.task_id for p in report.promotions] == ["d"]
    assert used(scalar, "tenant:2") == 0 and used(scalar, "tenant:3") == 1 and used(scalar, "stripe") == 3
    assert check_counters_once(ledger.engine) == []


def test_a_multi_key_waiter_stands_in_the_line_of_the_key_it_lacks(ledger: Ledger, scalar) -> None:
    """It parks in the line (and waiting room) of the first key, in its own order, that has no room; work on
    its other keys is not held up by it."""
    g = arrive(ledger, "g", "gate")  # holds "gate" (a mutex)
    w = arrive(ledger, "w", "acct:1", "gate")
    assert w.verdict is Verdict.PARKED
    assert scalar("SELECT key FROM keyed_waiting WHERE task_id = 'w'") == "gate"
    assert scalar("SELECT waiting FROM keyed_keys WHERE key = 'gate'") == 1
    assert arrive(ledger, "other", "acct:1").verdict is Verdict.ADMITTED  # acct:1 has room: not held up by w
    report = finish(ledger, "other", ledger.explain("other").facts["fence"])
    assert report.promotions == []
    report = finish(ledger, "g", g.fence)
    (p,) = report.promotions
    assert p.task_id == "w" and p.key == "acct:1"  # the claim's first key is the task's first key
    assert used(scalar, "acct:1") == 1 and used(scalar, "gate") == 1
    assert scalar("SELECT waiting FROM keyed_keys WHERE key = 'gate'") == 0
    assert check_counters_once(ledger.engine) == []


def test_a_multi_key_attempt_is_not_starved_by_single_key_streams(ledger: Ledger, scalar) -> None:
    """W keeps its arrival number in every line it moves to, and holds the slots of the keys listed before
    the one it still lacks: it starts after at most one more task of each key, not after the streams."""
    x = arrive(ledger, "x0", "acct:1")  # holds acct:1
    g = arrive(ledger, "g0", "gate")  # holds gate
    assert arrive(ledger, "w", "acct:1", "gate").verdict is Verdict.PARKED  # in acct:1's line
    for i in range(1, 4):  # streams of newer single-key work on both keys
        assert arrive(ledger, f"g{i}", "gate").verdict is Verdict.PARKED
        assert arrive(ledger, f"x{i}", "acct:1").verdict is Verdict.PARKED
    # gate frees: w is not in gate's line, so g1 starts
    (p1,) = finish(ledger, "g0", g.fence).promotions
    assert p1.task_id == "g1"
    # acct:1 frees: w is first in its line but gate is busy (g1): w reserves acct:1 and moves to gate's line,
    # ahead of g2 and g3 (its arrival number is older); x1 does not get acct:1
    assert finish(ledger, "x0", x.fence).promotions == []
    assert scalar("SELECT key FROM keyed_waiting WHERE task_id = 'w'") == "gate"
    assert scalar("SELECT reserved_keys FROM keyed_waiting WHERE task_id = 'w'") == ["acct:1"]
    assert used(scalar, "acct:1") == 1  # held for w
    assert arrive(ledger, "late", "acct:1").verdict is Verdict.PARKED
    assert check_counters_once(ledger.engine) == []
    # g1 finishes: w starts with both keys, before g2, g3 and every x
    (pw,) = finish(ledger, "g1", ledger.bind(p1.token, p1.nonce)).promotions
    assert pw.task_id == "w"
    assert used(scalar, "acct:1") == 1 and used(scalar, "gate") == 1
    report = finish(ledger, "w", ledger.bind(pw.token, pw.nonce))
    assert sorted(p.task_id for p in report.promotions) == ["g2", "x1"]
    assert check_counters_once(ledger.engine) == []


def test_reservations_lapse_after_the_timeout(ledger: Ledger, clock, scalar) -> None:
    x = arrive(ledger, "x0", "acct:1", now=clock())
    g = arrive(ledger, "g0", "gate", now=clock())
    arrive(ledger, "w", "acct:1", "gate", now=clock())
    arrive(ledger, "x1", "acct:1", now=clock())
    finish(ledger, "x0", x.fence, now=clock())  # w reserves acct:1, waits for gate
    assert used(scalar, "acct:1") == 1 and scalar("SELECT reserved_keys FROM keyed_waiting WHERE task_id='w'")
    assert ledger.sweep(now=clock.advance(30)).promotions == []
    report = ledger.sweep(now=clock.advance(31))  # default timeout 60 s: given back, x1 starts
    assert [p.task_id for p in report.promotions] == ["x1"]
    assert scalar("SELECT reserved_keys FROM keyed_waiting WHERE task_id='w'") is None
    assert check_counters_once(ledger.engine) == []
    _ = g


def test_expired_or_revoked_waiter_gives_its_reservation_back(ledger: Ledger, clock, scalar) -> None:
    x = arrive(ledger, "x0", "acct:1", now=clock())
    arrive(ledger, "g0", "gate", now=clock())
    arrive(ledger, "w", "acct:1", "gate", now=clock())
    arrive(ledger, "x1", "acct:1", now=clock())
    finish(ledger, "x0", x.fence, now=clock())
    assert used(scalar, "acct:1") == 1
    promotions = ledger.revoke("w", now=clock())
    assert [p.task_id for p in promotions] == ["x1"]
    assert ledger.books()["revoked"] == 1
    assert check_counters_once(ledger.engine) == []


def test_heavy_attempt_starts_only_when_its_cost_fits(ledger: Ledger, scalar) -> None:
    ledger.configure({"api": NameConfig("api", limit=10)})
    light = [arrive(ledger, f"l{i}", "api:x") for i in range(6)]
    heavy = arrive(ledger, "heavy", "api:x", cost=5)
    assert heavy.verdict is Verdict.PARKED
    assert arrive(ledger, "after", "api:x").verdict is Verdict.PARKED
    # 6 in use: one release makes 5 in use, and then the heavy one fits (5 + 5 = 10)
    report = finish(ledger, "l0", light[0].fence)
    assert [p.task_id for p in report.promotions] == ["heavy"]
    assert used(scalar, "api:x") == 10
    # full: the light one behind waits
    report = finish(ledger, "l1", light[1].fence)
    assert [p.task_id for p in report.promotions] == ["after"]
    assert used(scalar, "api:x") == 10
    assert check_counters_once(ledger.engine) == []


def test_protected_capacity(ledger: Ledger, scalar) -> None:
    """Optional work takes ["stripe-optional", "stripe"] (7 of 10); essential work takes ["stripe"] and always
    finds room while optional work floods."""
    ledger.configure(
        {"stripe": NameConfig("stripe", limit=10), "stripe-optional": NameConfig("stripe-optional", limit=7)}
    )
    verdicts = [arrive(ledger, f"opt{i}", "stripe-optional", "stripe").verdict for i in range(20)]
    assert verdicts.count(Verdict.ADMITTED) == 7 and verdicts.count(Verdict.PARKED) == 13
    essential = [arrive(ledger, f"ess{i}", "stripe").verdict for i in range(3)]
    assert essential == [Verdict.ADMITTED] * 3
    assert used(scalar, "stripe") == 10 and used(scalar, "stripe-optional") == 7


def test_multi_key_waiter_skipped_for_a_busy_row_is_promoted_by_the_sweep(ledger: Ledger, engine, scalar) -> None:
    """A promotion through one key takes the waiter's other keys without waiting (out of lock order); when
    one of their rows is locked at that moment, the sweep's in-order promotion starts it (D2 backstop)."""
    g = arrive(ledger, "g", "gate")
    assert arrive(ledger, "w", "acct:1", "gate").verdict is Verdict.PARKED
    locked, done = threading.Event(), threading.Event()

    def hold_acct_row() -> None:
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT 1 FROM keyed_slots WHERE key = 'acct:1' FOR UPDATE"))
            locked.set()
            done.wait(10)

    holder = threading.Thread(target=hold_acct_row)
    holder.start()
    try:
        assert locked.wait(10)
        assert finish(ledger, "g", g.fence).promotions == []  # acct:1's row was busy: skipped, not waited for
    finally:
        done.set()
        holder.join()
    assert used(scalar, "gate") == 0 and used(scalar, "acct:1") == 0  # nothing half-taken
    report = promote_all(ledger.engine)
    assert [p.task_id for p in report.promotions] == ["w"]
    assert used(scalar, "gate") == 1 and used(scalar, "acct:1") == 1
    with engine.begin() as conn:  # nothing left to promote: idempotent
        assert promote_multi(conn, Token("w", 0)) == []
    assert check_counters_once(ledger.engine) == []


def test_reclaim_frees_every_key_of_a_lost_multi_key_claim(ledger: Ledger, clock, scalar) -> None:
    a = arrive(ledger, "a", "acct:1", "gate", now=clock())
    assert a.verdict is Verdict.ADMITTED
    b = arrive(ledger, "b", "acct:2", "gate", now=clock())
    assert b.verdict is Verdict.PARKED
    report = ledger.reconcile(now=clock.advance(ledger.lease + 1))
    assert [t.task_id for t in report.reclaimed] == ["a"]
    assert [p.task_id for p in report.promotions] == ["b"]
    assert used(scalar, "acct:1") == 0 and used(scalar, "acct:2") == 1 and used(scalar, "gate") == 1
    assert report.drift == []


def test_a_cost_no_key_can_ever_have_is_rejected(ledger: Ledger) -> None:
    ledger.configure({"api": NameConfig("api", limit=4, shards=2)})
    verdict = arrive(ledger, "a", "api:1", cost=3)  # shares are 2 + 2
    assert verdict.verdict is Verdict.REJECTED and "exceeds the 2 slots" in verdict.detail
    assert ledger.books()["rejected"] == 1
    assert arrive(ledger, "b", "api:1", cost=2).verdict is Verdict.ADMITTED


def test_counters_check_counts_costs_and_extra_keys(ledger: Ledger, engine, scalar) -> None:
    ledger.configure({"api": NameConfig("api", limit=5), "gate": NameConfig("gate", limit=5)})
    arrive(ledger, "a", "api:1", "gate:1", cost=3)
    assert used(scalar, "api:1") == 3 and used(scalar, "gate:1") == 3
    assert check_counters_once(engine) == []
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE keyed_slots SET used = 1 WHERE key = 'gate:1'"))
    drift = check_counters_once(engine)
    assert drift == ["gate:1 shard 0: used 1 but 3 claims exist"]
    assert used(scalar, "gate:1") == 3


def test_uncertain_hold_keeps_the_slot_after_a_hard_time_limit(ledger: Ledger, clock, scalar) -> None:
    ledger.configure({"bank": NameConfig("bank", limit=1, uncertain_hold=30.0)}, now=clock())
    a = arrive(ledger, "a", "bank:1", now=clock())
    b = arrive(ledger, "b", "bank:1", now=clock())
    assert b.verdict is Verdict.PARKED
    report = finish(ledger, "a", a.fence, Outcome.FAILED, uncertain=True, now=clock())
    assert report.released and report.promotions == []
    assert ledger.books()["failed"] == 1  # the outcome is recorded now
    assert used(scalar, "bank:1") == 1  # the slot is still held
    explained = ledger.explain("a", now=clock())
    assert explained.state == "uncertain" and "may still be running" in explained.text
    assert ledger.sweep(now=clock.advance(29)).promotions == []
    # a second release of the same attempt is a no-op (fenced)
    assert not finish(ledger, "a", a.fence, Outcome.FAILED, now=clock()).released
    report = ledger.sweep(now=clock.advance(2))
    assert [p.task_id for p in report.promotions] == ["b"]
    assert ledger.explain("a", now=clock()).state == "finished"
    assert check_counters_once(ledger.engine) == []


def test_uncertain_hold_of_a_lost_worker_runs_the_redelivery_after_the_hold(ledger: Ledger, clock, scalar) -> None:
    a = arrive(ledger, "a", "bank:1", now=clock())
    # the task's own hold (no name config): its worker was lost, the broker redelivers the same attempt
    report = finish(ledger, "a", a.fence, Outcome.WORKER_LOST, uncertain=True, hold=10.0, now=clock())
    assert report.released
    again = arrive(ledger, "a", "bank:1", now=clock())
    assert again.verdict is Verdict.DUPLICATE and "shadow" in again.detail
    assert ledger.sweep(now=clock.advance(5)).promotions == []
    report = ledger.sweep(now=clock.advance(6))
    assert [p.task_id for p in report.promotions] == ["a"]
    assert used(scalar, "bank:1") == 1


def test_no_uncertain_hold_configured_releases_at_once(ledger: Ledger, scalar) -> None:
    a = arrive(ledger, "a", "bank:1")
    arrive(ledger, "b", "bank:1")
    report = finish(ledger, "a", a.fence, Outcome.FAILED, uncertain=True)
    assert [p.task_id for p in report.promotions] == ["b"]


def test_release_early_frees_the_slots_and_the_outcome_is_still_booked(ledger: Ledger, scalar) -> None:
    a = arrive(ledger, "a", "acct:1", "gate")
    arrive(ledger, "b", "acct:1")
    released, promotions = ledger.release_early(Token("a", 0), a.fence)
    assert released and [p.task_id for p in promotions] == ["b"]
    assert used(scalar, "gate") == 0 and used(scalar, "acct:1") == 1  # b's
    assert ledger.release_early(Token("a", 0), a.fence) == (False, [])  # once
    assert ledger.release_early(Token("a", 0), a.fence + 99) == (False, [])  # fenced
    assert ledger.explain("a").state == "running"
    report = ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED)
    assert report.released and ledger.books()["completed"] == 1
    assert used(scalar, "acct:1") == 1 and check_counters_once(ledger.engine) == []


def test_rate_limit_parks_until_the_token_exists(ledger: Ledger, clock, scalar) -> None:
    ledger.configure({"api": NameConfig("api", limit=10, rate=2.0, burst=2)}, now=clock())
    verdicts = [arrive(ledger, t, "api:x", now=clock()).verdict for t in "abcd"]
    assert verdicts == [Verdict.ADMITTED, Verdict.ADMITTED, Verdict.PARKED, Verdict.PARKED]
    assert used(scalar, "api:x") == 2  # the parked ones took no slot (and no token)
    waits = scalar("SELECT min(extract(epoch FROM not_before - :now)) FROM keyed_waiting", now=clock())
    assert 0.45 < float(waits) < 0.55  # parked with the time its token will exist: no polling
    assert ledger.sweep(now=clock.advance(0.4)).promotions == []
    report = ledger.sweep(now=clock.advance(0.2))  # t = 0.6: one token
    assert [p.task_id for p in report.promotions] == ["c"]
    report = ledger.sweep(now=clock.advance(0.2))  # t = 0.8: 0.6 tokens, d waits
    assert report.promotions == []
    report = ledger.sweep(now=clock.advance(0.3))  # t = 1.1: 1.2 tokens
    assert [p.task_id for p in report.promotions] == ["d"]
    assert check_counters_once(ledger.engine) == []


def test_a_take_stamped_earlier_than_the_last_refills_nothing_twice(ledger: Ledger, clock, scalar) -> None:
    """A claim's time is its transaction's start (``now()``), and a transaction that began earlier can reach the key's
    row after a later one took a token (it waited for the row's lock). Its take must not move the bucket's clock
    back: the time between its stamp and the later take's would be refilled a second time at the next take, and
    more starts would fit in a window than the rate allows. Rate 1/s, burst 2: a take at t = 1 (2 tokens, 1 left), a
    take stamped t = 0 that commits after it (the last token), then at t = 1.5 only half a token exists."""
    ledger.configure({"api": NameConfig("api", limit=10, rate=1.0, burst=2)}, now=clock())
    t0 = clock()
    assert arrive(ledger, "a", "api:x", now=clock.advance(1.0)).verdict is Verdict.ADMITTED
    assert arrive(ledger, "b", "api:x", now=t0).verdict is Verdict.ADMITTED  # began before a's, committed after it
    assert scalar("SELECT tokens_at = :at FROM keyed_keys WHERE key = 'api:x'", at=clock()) is True
    late = arrive(ledger, "c", "api:x", now=clock.advance(0.5))
    assert late.verdict is Verdict.PARKED  # 0.5 tokens since t = 1, not 1.5 since t = 0
    waits = scalar("SELECT extract(epoch FROM not_before - :now) FROM keyed_waiting WHERE task_id = 'c'", now=clock())
    assert 0.45 < float(waits) < 0.55  # parked with the time its token exists (t = 2)
    assert used(scalar, "api:x") == 2 and check_counters_once(ledger.engine) == []


def test_the_bucket_holds_its_rate_over_takes_stamped_out_of_order(ledger: Ledger, clock) -> None:
    """Seeded random takes, two in five stamped up to 0.6 s before the latest (transactions that began earlier and
    took after later ones). The calls' order is the order they committed, so a take happened no earlier than every
    stamp before it: between any two starts there were at most rate x that time + burst starts."""
    rate, burst = 5.0, 3
    ledger.configure({"api": NameConfig("api", limit=1000, rate=rate, burst=burst)}, now=clock())
    rnd = random.Random(27)
    latest = clock()
    starts = []  # the earliest time each start can have happened: the latest stamp so far
    for i in range(300):
        clock.advance(rnd.uniform(0.0, 0.15))
        stamp = clock() - timedelta(seconds=rnd.uniform(0.0, 0.6)) if rnd.random() < 0.4 else clock()
        latest = max(latest, stamp)
        admission = arrive(ledger, f"t{i}", "api:x", now=stamp)
        if admission.verdict is Verdict.ADMITTED:
            starts.append(latest)
        else:
            assert admission.verdict is Verdict.PARKED
            ledger.revoke(f"t{i}", now=clock())  # out of the line: the next take is a first in line again
    assert len(starts) > 100  # the rate bound the run, and let most of it through
    for i, first in enumerate(starts):
        for j in range(i, len(starts)):
            allowed = rate * (starts[j] - first).total_seconds() + burst
            assert j - i + 1 <= allowed + 1e-9, f"{j - i + 1} starts within {(starts[j] - first).total_seconds()} s"


def test_rate_and_gate_debit_neither_when_either_refuses(ledger: Ledger, clock, scalar) -> None:
    ledger.configure({"api": NameConfig("api", limit=1, rate=10.0, burst=5)}, now=clock())
    a = arrive(ledger, "a", "api:x", now=clock())
    assert a.verdict is Verdict.ADMITTED
    assert scalar("SELECT tokens FROM keyed_keys WHERE key = 'api:x'") == 4
    assert arrive(ledger, "b", "api:x", now=clock()).verdict is Verdict.PARKED  # the gate refuses
    assert scalar("SELECT tokens FROM keyed_keys WHERE key = 'api:x'") == 4  # no token debited
    # empty the bucket through a second key of a multi-key task: the gate of the other key is not debited
    ledger.configure({"bucket": NameConfig("bucket", limit=5, rate=1.0, burst=1)}, now=clock())
    assert arrive(ledger, "c", "bucket:1", now=clock()).verdict is Verdict.ADMITTED
    d = arrive(ledger, "d", "acct:1", "bucket:1", now=clock())
    assert d.verdict is Verdict.PARKED
    assert used(scalar, "acct:1") == 0 and used(scalar, "bucket:1") == 1
    report = ledger.sweep(now=clock.advance(1.1))
    assert [p.task_id for p in report.promotions] == ["d"]
    assert used(scalar, "acct:1") == 1 and used(scalar, "bucket:1") == 2
    _ = a


def test_a_rate_no_bucket_can_hold_rejects_a_heavy_task(ledger: Ledger) -> None:
    ledger.configure({"api": NameConfig("api", limit=10, rate=1.0, burst=2)})
    verdict = arrive(ledger, "a", "api:x", cost=3)
    assert verdict.verdict is Verdict.REJECTED and "tokens" in verdict.detail


def fair_arrive(ledger: Ledger, task_id: str, tenant: str, *keys: str):
    return ledger.admit(
        Arrival(task_id=task_id, key=keys[0], extra_keys=tuple(keys[1:]), fair_key=tenant, message={"id": task_id})
    )


def test_fair_sharing_serves_a_late_tenant_next(ledger: Ledger) -> None:
    ledger.configure({"stripe": NameConfig("stripe", limit=2, fair=True)})
    fences = {}
    for i in range(10):
        admission = fair_arrive(ledger, f"a{i}", "A", "stripe")
        if admission.admitted:
            fences[f"a{i}"] = admission.fence
    assert len(fences) == 2
    for i in range(3):
        assert fair_arrive(ledger, f"b{i}", "B", "stripe").verdict is Verdict.PARKED
    order = []
    running = dict(fences)
    while running:
        task_id, fence = next(iter(running.items()))
        del running[task_id]
        for p in ledger.release(Token(task_id, 0), fence, Outcome.COMPLETED).promotions:
            order.append(p.task_id)
            running[p.task_id] = ledger.bind(p.token, p.nonce)
        if len(order) >= 8:
            break
    # B's first task is next, and B's three alternate with A's backlog instead of waiting behind it
    assert order[0] == "b0"
    assert [t for t in order[:6] if t.startswith("b")] == ["b0", "b1", "b2"]


def test_fair_share_is_by_fair_key_whatever_the_concurrency_keys(ledger: Ledger) -> None:
    """Spreading A's backlog over many concurrency keys gives A no extra share of the fair gate."""
    ledger.configure({"stripe": NameConfig("stripe", limit=2, fair=True)})
    fences = {}
    for i in range(8):
        admission = fair_arrive(ledger, f"a{i}", "A", f"acct:a{i}", "stripe")
        if admission.admitted:
            fences[f"a{i}"] = admission.fence
    assert len(fences) == 2
    assert fair_arrive(ledger, "b0", "B", "acct:b0", "stripe").verdict is Verdict.PARKED
    task_id, fence = next(iter(fences.items()))
    (p,) = ledger.release(Token(task_id, 0), fence, Outcome.COMPLETED).promotions
    assert p.task_id == "b0"


def test_an_uncontended_multi_key_claim_is_one_statement_like_a_single_key_claim(ledger: Ledger, engine) -> None:
    """Issue 4: the multi-key claim costs at most one extra round trip (it costs none: one statement)."""
    for task_id, keys in (("warm1", ("acct:1",)), ("warm2", ("acct:2", "gate:1", "region:eu"))):
        warm = arrive(ledger, task_id, *keys)  # a key's counter rows exist after its first use
        ledger.release(Token(task_id, 0), warm.fence, Outcome.COMPLETED)
    statements: list[str] = []

    def count(conn, cursor, statement, parameters, context, executemany) -> None:
        statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        assert arrive(ledger, "single", "acct:1").verdict is Verdict.ADMITTED
        single = len(statements)
        statements.clear()
        assert arrive(ledger, "multi", "acct:2", "gate:1", "region:eu").verdict is Verdict.ADMITTED
        multi = len(statements)
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)
    assert single == 1 and multi == 1, (single, multi)
