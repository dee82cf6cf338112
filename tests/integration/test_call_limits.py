"""Limits computed from the call, in the ledger on real Postgres: an arrival's ``call_limit`` is its key's limit
(stored with the key) after the operators' overrides and before the name's configured limit; when two calls of one
key disagree the latest arrival's limit holds; a raise promotes the key's line in the arrival's transaction (D2),
a lower never preempts; other keys of the name keep theirs; reconcile forgets the limits of keys idle for a day."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict, explain, status_keys
from celery_keyed.ledger.reconcile import check_counters_once


def running(scalar: Callable[..., object], key: str) -> int:
    return int(scalar("SELECT count(*) FROM keyed_claims WHERE key = :key", key=key) or 0)


def stored(scalar: Callable[..., object], key: str) -> object:
    return scalar("SELECT slot_limit FROM keyed_call_limits WHERE key = :key", key=key)


def arrival(task_id: str, key: str, limit: int | None) -> Arrival:
    return Arrival(task_id, key=key, call_limit=limit, message={"id": task_id})


def test_each_key_runs_as_many_as_its_calls_say(ledger: Ledger, scalar, clock) -> None:
    ledger.configure({"tenant": NameConfig("tenant", limit=1)}, now=clock())
    premium = [ledger.admit(arrival(f"p{i}", "tenant:gold", 3), now=clock()) for i in range(4)]
    basic = [ledger.admit(arrival(f"b{i}", "tenant:tin", 1), now=clock()) for i in range(2)]
    plain = [ledger.admit(Arrival(f"n{i}", key="tenant:none", message={}), now=clock()) for i in range(2)]
    assert [a.verdict for a in premium] == [Verdict.ADMITTED] * 3 + [Verdict.PARKED]
    assert [a.verdict for a in basic] == [Verdict.ADMITTED, Verdict.PARKED]
    assert [a.verdict for a in plain] == [Verdict.ADMITTED, Verdict.PARKED]  # no call limit: the name's 1
    assert (stored(scalar, "tenant:gold"), stored(scalar, "tenant:tin"), stored(scalar, "tenant:none")) == (3, 1, None)
    assert check_counters_once(ledger.engine) == []


def test_the_latest_arrival_sets_the_limit_a_raise_starts_the_line_at_once(ledger: Ledger, scalar, clock) -> None:
    first = ledger.admit(arrival("a", "tenant:1", 1), now=clock())
    assert first.admitted
    assert ledger.admit(arrival("b", "tenant:1", 1), now=clock()).verdict is Verdict.PARKED
    assert ledger.admit(arrival("c", "tenant:1", 1), now=clock()).verdict is Verdict.PARKED
    # The tenant upgraded: the next call computes 3. Its arrival gives the room to the line first (b, c: FIFO),
    # in its own transaction, and then has none left for itself.
    d = ledger.admit(arrival("d", "tenant:1", 3), now=clock())
    assert [p.task_id for p in d.promotions] == ["b", "c"]
    assert d.verdict is Verdict.PARKED
    assert stored(scalar, "tenant:1") == 3
    # A downgrade preempts nothing: a, b and c go on, and nothing starts until fewer than 2 run.
    e = ledger.admit(arrival("e", "tenant:1", 2), now=clock())
    assert e.verdict is Verdict.PARKED and e.promotions == ()
    assert running(scalar, "tenant:1") == 3
    promoted = ledger.release(Token("a", 0), first.fence, Outcome.COMPLETED, now=clock()).promotions
    assert promoted == []  # 2 still run (b and c, promoted): at the new limit
    assert stored(scalar, "tenant:1") == 2
    assert check_counters_once(ledger.engine) == []


def test_a_raise_by_an_arrival_that_cannot_start_still_starts_the_line(ledger: Ledger, scalar, clock) -> None:
    """The room a raise makes belongs to the line whether or not it fits the arrival that raised it."""
    a = ledger.admit(arrival("a", "tenant:1", 1), now=clock())
    assert ledger.admit(arrival("b", "tenant:1", 1), now=clock()).verdict is Verdict.PARKED
    heavy = ledger.admit(Arrival("h", key="tenant:1", cost=2, call_limit=2, message={}), now=clock())
    assert [p.task_id for p in heavy.promotions] == ["b"]
    assert heavy.verdict is Verdict.PARKED
    assert a.admitted and running(scalar, "tenant:1") == 2


def test_a_weighted_call_is_measured_against_its_calls_limit(ledger: Ledger, clock) -> None:
    """Costs meet call limits: an attempt heavier than its name's configured limit but not than its call's starts;
    one heavier than its call's limit is turned away at once (it could never start), not left waiting."""
    ledger.configure({"tenant": NameConfig("tenant", limit=1)}, now=clock())
    assert ledger.admit(Arrival("w", key="tenant:1", cost=3, call_limit=5, message={}), now=clock()).admitted
    too_heavy = ledger.admit(Arrival("x", key="tenant:2", cost=3, call_limit=2, message={}), now=clock())
    assert too_heavy.verdict is Verdict.REJECTED and "cost 3 exceeds the 2 slots" in too_heavy.detail
    # A task without a limit of its own on a key whose latest call stored one is measured against that one: the
    # key's limit is the key's, whichever task set it.
    plain = ledger.admit(Arrival("y", key="tenant:1", cost=3, message={}), now=clock())
    assert plain.verdict is Verdict.PARKED  # w holds 3 of 5: it waits for room, it is not "too heavy"


def test_the_operators_word_wins_over_the_call(ledger: Ledger, scalar, clock) -> None:
    for i in range(4):
        ledger.admit(arrival(f"t{i}", "tenant:1", 3), now=clock())
    assert running(scalar, "tenant:1") == 3
    # A key override wins over the call: lowered to 1, nothing new starts while more than 1 runs.
    ledger.set_key_limit("tenant:1", 1, reason="incident", now=clock())
    assert ledger.admit(arrival("u", "tenant:1", 3), now=clock()).verdict is Verdict.PARKED
    ledger.clear_key_limit("tenant:1", reason="over", now=clock())
    # A live override of the name wins over the call too (the operator throttles every key of the name).
    ledger.set_override("tenant", 2, reason="slow upstream", now=clock())
    assert ledger.admit(arrival("v", "tenant:1", 5), now=clock()).verdict is Verdict.PARKED
    assert running(scalar, "tenant:1") == 3
    # A paused name pauses every key, whatever its calls say.
    ledger.set_override("tenant", 0, reason="maintenance", now=clock())
    assert ledger.admit(arrival("w", "tenant:9", 5), now=clock()).verdict is Verdict.PARKED
    # The override cleared, the latest call's 5 holds again: tenant:1's line starts in order up to 5 running (t3, u;
    # v waits), and w on its own key.
    promoted = ledger.clear_override("tenant", reason="done", now=clock())
    assert sorted(p.task_id for p in promoted) == ["t3", "u", "w"]
    assert running(scalar, "tenant:1") == 5 and check_counters_once(ledger.engine) == []


def test_a_call_limit_of_zero_holds_the_key_until_a_later_call_or_an_operator_raises_it(
    ledger: Ledger, scalar, clock
) -> None:
    assert ledger.admit(arrival("a", "tenant:1", 0), now=clock()).verdict is Verdict.PARKED
    promoted = ledger.set_key_limit("tenant:1", 1, reason="let one through", now=clock())
    assert [p.task_id for p in promoted] == ["a"]


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3", 2**31])
def test_a_bad_call_limit_is_refused_before_the_ledger(bad: object) -> None:
    with pytest.raises(ValueError, match="call_limit"):
        Arrival("a", key="tenant:1", call_limit=bad)  # type: ignore[arg-type]


def test_reconcile_forgets_the_limits_of_keys_idle_for_a_day(ledger: Ledger, scalar, clock) -> None:
    a = ledger.admit(arrival("a", "tenant:1", 3), now=clock())
    assert ledger.admit(arrival("b", "tenant:2", 0), now=clock()).verdict is Verdict.PARKED
    ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED, now=clock())
    ledger.reconcile(now=clock.advance(3600))
    assert stored(scalar, "tenant:1") == 3  # idle an hour: kept (at least a day)
    ledger.reconcile(now=clock.advance(86400))
    assert stored(scalar, "tenant:1") is None  # idle a day: forgotten
    assert stored(scalar, "tenant:2") == 0  # b still waits: kept


def test_status_and_explain_say_where_a_keys_limit_comes_from(ledger: Ledger, clock) -> None:
    ledger.configure({"tenant": NameConfig("tenant", limit=1)}, now=clock())
    for i in range(3):
        ledger.admit(arrival(f"g{i}", "tenant:gold", 2), now=clock())
    ledger.admit(arrival("z", "tenant:zero", 0), now=clock())
    ledger.admit(Arrival("n", key="tenant:none", message={}), now=clock())
    with ledger.engine.connect() as conn:
        keys = {k.key: k for k in status_keys(conn, name="tenant", now=clock())}
        assert (keys["tenant:gold"].limit, keys["tenant:gold"].source) == (2, "call")
        assert (keys["tenant:zero"].limit, keys["tenant:zero"].source) == (0, "call")
        assert (keys["tenant:none"].limit, keys["tenant:none"].source) == (1, "config")
        waiting = explain(conn, "g2", now=clock())
        assert "in flight 2/2" in waiting.text and "the limit its latest call computed (task g0" in waiting.text
        assert waiting.facts["call_limit"]["limit"] == 2 and waiting.facts["call_limit"]["in_effect"]
        held = explain(conn, "z", now=clock())
        assert held.state == "paused" and "limit 0, computed by its latest call (task z" in held.text
    # An override of the name wins: status and explain say so, not the call.
    ledger.set_override("tenant", 1, reason="incident", now=clock())
    with ledger.engine.connect() as conn:
        keys = {k.key: k for k in status_keys(conn, name="tenant", now=clock())}
        assert (keys["tenant:gold"].limit, keys["tenant:gold"].source) == (1, "override")
        waiting = explain(conn, "g2", now=clock())
        assert "latest call" not in waiting.text and not waiting.facts["call_limit"]["in_effect"]


def test_metrics_count_the_keys_whose_call_computed_their_limit(gauge, ledger: Ledger, clock) -> None:
    """celery_keyed_keys_call_limit, per name (never a series per key)."""
    ledger.admit(arrival("a", "tenant:1", 3), now=clock())
    ledger.admit(arrival("b", "tenant:2", 1), now=clock())
    ledger.admit(Arrival("c", key="tenant:3", message={}), now=clock())
    ledger.admit(Arrival("d", key="api:1", message={}), now=clock())
    assert gauge("celery_keyed_keys_call_limit", name="tenant") == 2
    assert gauge("celery_keyed_keys_call_limit", name="api") == 0


def test_a_batch_stores_its_limits_first_and_the_latest_of_a_key_wins(ledger: Ledger, scalar, clock) -> None:
    """admit_many stores every limit of the batch before deciding it (key by key, the batch's latest arrival of a key
    last): the whole batch runs under them, uncontended arrivals by the batch's one-statement claim, and the room a
    new limit makes goes to the key's line, carried by the answer of the arrival that set it."""
    assert ledger.admit(arrival("a", "tenant:1", 1), now=clock()).admitted
    assert ledger.admit(arrival("b", "tenant:1", 1), now=clock()).verdict is Verdict.PARKED
    batch = [arrival("c", "tenant:1", 1), arrival("x", "tenant:2", 2), arrival("d", "tenant:1", 3)]
    answers = ledger.admit_many(batch, now=clock())
    assert stored(scalar, "tenant:1") == 3 and stored(scalar, "tenant:2") == 2
    assert [p.task_id for p in answers[2].promotions] == ["b"]  # d set 3: b (waiting) starts first
    assert answers[0].promotions == () and answers[1].admitted
    assert [a.verdict for a in answers] == [Verdict.ADMITTED, Verdict.ADMITTED, Verdict.PARKED]  # a, b, c run: 3
    assert running(scalar, "tenant:1") == 3 and check_counters_once(ledger.engine) == []
    # A redelivery of a known attempt and an expired arrival store nothing.
    again = ledger.admit(Arrival("c", key="tenant:1", call_limit=1, message={}), now=clock())
    assert again.verdict is Verdict.DUPLICATE and stored(scalar, "tenant:1") == 3
    late = Arrival("e", key="tenant:1", call_limit=9, deadline=clock(), message={})
    assert ledger.admit(late, now=clock()).verdict is Verdict.EXPIRED and stored(scalar, "tenant:1") == 3
    # Park at receipt never decides an arrival that carries a limit (it would not store it).
    assert ledger.park_at_receipt(arrival("f", "tenant:1", 1), now=clock()) is None


def test_uncontended_calls_with_limits_take_the_one_statement_claim(
    ledger: Ledger, scalar, clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A limit from the call costs one more transaction per batch, not the general path per arrival: 50 arrivals on
    idle keys of a known name are all admitted by the batch's claim, with their limits stored."""
    from celery_keyed.ledger import admit as admit_module

    ledger.configure({"tenant": NameConfig("tenant", limit=1)}, now=clock())
    for i in range(50):  # first use of each key (rows created) and its release
        a = ledger.admit(arrival(f"w{i}", f"tenant:{i}", 2), now=clock())
        ledger.release(Token(f"w{i}", 0), a.fence, Outcome.COMPLETED, now=clock())
    general = []
    real = admit_module.admit
    monkeypatch.setattr(admit_module, "admit", lambda *a, **k: general.append(1) or real(*a, **k))
    answers = ledger.admit_many([arrival(f"t{i}", f"tenant:{i}", 2) for i in range(50)], now=clock())
    assert all(a.admitted for a in answers)
    assert general == []  # none took the general transaction
    assert scalar("SELECT count(*) FROM keyed_call_limits WHERE slot_limit = 2") == 50


def test_a_value_the_database_refuses_does_not_fail_the_others_limits(ledger: Ledger, scalar, clock) -> None:
    good = arrival("g", "tenant:1", 3)
    bad = Arrival("b", attempt=2**40, key="tenant:2", call_limit=2, message={})  # no integer column holds it
    answers = ledger.admit_many([good, bad], now=clock())
    assert answers[0].admitted and stored(scalar, "tenant:1") == 3
    assert answers[1].verdict is Verdict.REJECTED and "refused by the ledger's database" in answers[1].detail
    assert stored(scalar, "tenant:2") is None
