"""Weighted fair sharing (issue 14 item 5) on real Postgres: while several fair keys of a key wait, the next free slot
goes to the fair key with the lowest (slots held) / weight, so each one's share of the key's slots follows its weight,
a heavy tenant never gets a new slot above its weighted share while another waits below its share, weights come from
a runtime override, else the call, else the name's table, else 1, and they change at runtime (audited)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import (
    Arrival,
    InvalidConfig,
    Ledger,
    NameConfig,
    Outcome,
    Token,
    Verdict,
)

K = 4


def fair_arrive(ledger: Ledger, task_id: str, tenant: str, *, weight: float | None = None, key: str = "crm:eu"):
    return ledger.admit(
        Arrival(task_id=task_id, key=key, fair_key=tenant, fair_weight=weight, message={"id": task_id})
    )


class Gate:
    """The claims running under one key, released one at a time (oldest or at random) with their promotions bound,
    and after each step the slots each fair key holds."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.running: dict[str, int] = {}  # task id -> fence, in start order
        self.granted: list[tuple[str, Counter[str]]] = []  # (task id promoted, holdings just before it)

    def admit(self, task_id: str, tenant: str, **kw: Any) -> Verdict:
        admission = fair_arrive(self.ledger, task_id, tenant, **kw)
        if admission.admitted:
            self.running[task_id] = admission.fence
        return admission.verdict

    def holding(self) -> Counter[str]:
        return Counter(t[0] for t in self.running)  # task ids start with their tenant's letter

    def release(self, task_id: str) -> None:
        fence = self.running.pop(task_id)
        before = self.holding()
        for p in self.ledger.release(Token(task_id, 0), fence, Outcome.COMPLETED).promotions:
            self.granted.append((p.task_id, before.copy()))
            fence = self.ledger.bind(p.token, p.nonce)
            assert fence is not None
            self.running[p.task_id] = fence
            before[p.task_id[0]] += 1
        assert len(self.running) <= K  # the bound


def in_flight(engine: sa.Engine, key: str = "crm:eu") -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT sum(used) FROM keyed_slots WHERE key = :k"), {"k": key}).scalar())


@pytest.mark.parametrize("source", ["table", "call"])
def test_with_deep_backlogs_weights_3_to_1_hold_3_and_1_over_many_promotions(
    ledger: Ledger, engine: sa.Engine, source: str
) -> None:
    """K = 4, tenant a weight 3 (from the name's table or from the calls), tenant b weight 1, both with deep
    backlogs: a came first and holds all four slots; from b's first promotion on, every state is 3 + 1, over a long
    run of releases in random order; and the books balance at the end."""
    table = {"a": 3} if source == "table" else None
    ledger.configure({"crm": NameConfig("crm", limit=K, fair=True, fair_weights=table)})
    weight_a = 3 if source == "call" else None
    gate = Gate(ledger)
    for i in range(100):
        gate.admit(f"a{i:03d}", "a", weight=weight_a)
    assert gate.holding() == Counter({"a": K})  # nobody else waited: a took every slot (work-conserving)
    for i in range(100):
        assert gate.admit(f"b{i:03d}", "b") is Verdict.PARKED
    rng = random.Random(5)
    gate.release("a000")  # a holds 4 > its share 3 while b waits: the slot goes to b
    assert gate.granted[-1][0] == "b000"
    states = []
    for _ in range(80):
        gate.release(rng.choice(sorted(gate.running)))
        states.append(gate.holding())
    assert all(s == Counter({"a": 3, "b": 1}) for s in states), states
    assert in_flight(engine) == K
    while gate.running:  # drain: one outcome per task id, the books balance
        gate.release(sorted(gate.running)[0])
    books = ledger.books()
    assert books == {"completed": 200, "arrivals": 200}, books


def test_slots_freed_together_are_shared_by_weight_too(ledger: Ledger) -> None:
    """A paused gate resumed (four slots free at once) gives them 3 + 1: every promotion reads the loads again."""
    ledger.configure({"crm": NameConfig("crm", limit=K, fair=True, fair_weights={"a": 3})})
    ledger.set_override("crm", 0, reason="maintenance")
    gate = Gate(ledger)
    for i in range(10):
        assert gate.admit(f"a{i}", "a") is Verdict.PARKED
        assert gate.admit(f"b{i}", "b") is Verdict.PARKED
    promotions = ledger.clear_override("crm", reason="back")
    assert Counter(p.task_id[0] for p in promotions) == Counter({"a": 3, "b": 1})


def test_a_heavy_tenant_never_gets_a_slot_above_its_share_while_another_waits_below_it(ledger: Ledger) -> None:
    """Three tenants with weights 2, 1, 1 on K = 4 (shares 2, 1, 1); h publishes 20 times more than the others,
    tasks finish in random order. Whenever a slot went to h while another tenant waited, h held less than its
    weighted share relative to that tenant (load below theirs), so h never runs more than 2 while x or y waits."""
    ledger.configure({"crm": NameConfig("crm", limit=K, fair=True, fair_weights={"h": 2})})
    gate = Gate(ledger)
    for i in range(200):
        gate.admit(f"h{i:03d}", "h")
    for i in range(10):
        gate.admit(f"x{i:03d}", "x")
        gate.admit(f"y{i:03d}", "y")
    rng = random.Random(11)
    waiting = Counter({"h": 196, "x": 10, "y": 10})
    weights = {"h": 2.0, "x": 1.0, "y": 1.0}
    over = []
    converged = False
    while waiting["x"] or waiting["y"]:
        gate.release(rng.choice(sorted(gate.running)))
        for task_id, before in gate.granted:
            tenant = task_id[0]
            others = [t for t in weights if t != tenant and waiting[t] > 0]
            for other in others:  # the promoted tenant's load was the lowest of those waiting (ties: arrival)
                if before[tenant] / weights[tenant] > before[other] / weights[other]:
                    over.append((task_id, dict(before), other))
            waiting[tenant] -= 1
        gate.granted.clear()
        # h came first and held all 4; once down to its share it never holds more while x and y wait
        converged = converged or gate.holding()["h"] <= 2
        if converged and waiting["x"] and waiting["y"]:
            assert gate.holding()["h"] <= 2, gate.holding()
    assert over == []
    assert converged


def test_weights_change_at_runtime_audited_and_lapse(
    ledger: Ledger, engine: sa.Engine, clock: Callable[..., Any]
) -> None:
    """Equal weights share 2 + 2; an override of a to 3 makes it 3 + 1 from the next promotions on (running tasks are
    never stopped); clearing it brings 2 + 2 back; an override with an expiry lapses by itself (the sweep logs it).
    Every change is in keyed_fair_weight_log."""
    ledger.configure({"crm": NameConfig("crm", limit=K, fair=True)})
    gate = Gate(ledger)
    for i in range(100):
        gate.admit(f"a{i:03d}", "a")
    for i in range(100):
        gate.admit(f"b{i:03d}", "b")

    def run(steps: int) -> Counter[str]:
        for _ in range(steps):
            gate.release(next(iter(gate.running)))  # the oldest finishes first
        return gate.holding()

    assert run(8) == Counter({"a": 2, "b": 2})
    ledger.set_fair_weight("crm", "a", 3, reason="a bought the big plan", author="ops")
    assert gate.holding() == Counter({"a": 2, "b": 2})  # no preemption: it applies at the next promotions
    assert run(8) == Counter({"a": 3, "b": 1})
    assert ledger.clear_fair_weight("crm", "a", reason="plan ended", author="ops") is True
    assert ledger.clear_fair_weight("crm", "a") is False  # nothing to clear
    assert run(8) == Counter({"a": 2, "b": 2})
    ledger.set_fair_weight("crm", "b", 3, reason="for a minute", expires_at=clock() + timedelta(seconds=60))
    assert run(8) == Counter({"a": 1, "b": 3})
    ledger.sweep(now=clock() + timedelta(seconds=61))
    # The override lapsed (keyed_fair_weight ignores it past its expiry): equal again.
    with engine.connect() as conn:
        weight = conn.execute(sa.text("SELECT keyed_fair_weight('crm', 'b', NULL, now())")).scalar()
        log = conn.execute(
            sa.text("SELECT prefix, action, old_weight, new_weight, author FROM keyed_fair_weight_log ORDER BY id")
        ).all()
    assert weight == 1.0
    assert [tuple(r) for r in log] == [
        ("a", "set", None, 3.0, "ops"),
        ("a", "clear", 3.0, None, "ops"),
        ("b", "set", None, 3.0, ""),
        ("b", "expire", 3.0, None, ""),
    ]


def test_which_weight_applies_override_then_call_then_table_then_1_by_longest_prefix(
    ledger: Ledger, engine: sa.Engine
) -> None:
    ledger.configure({
        "crm": NameConfig("crm", limit=K, fair=True, fair_weights={"tenant": 2, "tenant:big": 5}),
    })

    def weight(fair_key: str | None, call: float | None = None) -> float:
        with engine.connect() as conn:
            return float(
                conn.execute(
                    sa.text("SELECT keyed_fair_weight('crm', CAST(:f AS text), CAST(:w AS double precision), now())"),
                    {"f": fair_key, "w": call},
                ).scalar()
            )

    assert weight("tenant:7") == 2  # "tenant" matches every tenant:*
    assert weight("tenant:big") == 5 and weight("tenant:big:eu") == 5  # the longest match wins
    assert weight("tenant:bigger") == 2  # a prefix ends at a ':'
    assert weight("tenants") == 1 and weight(None) == 1  # no match: 1
    assert weight("tenant:big", call=7) == 7  # the call's weight wins over the table
    ledger.set_fair_weight("crm", "tenant:big", 0.5, reason="incident")
    assert weight("tenant:big", call=7) == 0.5  # an override wins over both
    assert weight("tenant:7") == 2  # only what it matches
    with pytest.raises(InvalidConfig):
        ledger.set_fair_weight("crm", "tenant", 0, reason="zero")
    with pytest.raises(InvalidConfig):
        ledger.set_fair_weight("crm", "tenant", 2, reason=" ")
    with pytest.raises(InvalidConfig):
        NameConfig("crm", limit=2, fair=True, fair_weights={"t": -1})
    with pytest.raises(InvalidConfig):
        NameConfig("crm", limit=2, fair_weights={"t": 2})  # weights need a fair name


def test_explain_and_fair_shares_show_weights_holdings_and_loads(ledger: Ledger) -> None:
    ledger.configure({"crm": NameConfig("crm", limit=2, fair=True, fair_weights={"a": 3})})
    gate = Gate(ledger)
    for i in range(3):
        gate.admit(f"a{i}", "a")
    gate.admit("b0", "b")
    gate.admit("b1", "b")
    shares = {s.fair_key: s for s in ledger.fair_shares(key="crm:eu")}
    assert (shares["a"].holding, shares["a"].waiting, shares["a"].weight) == (2, 1, 3.0)
    assert (shares["b"].holding, shares["b"].waiting, shares["b"].weight) == (0, 2, 1.0)
    assert shares["a"].share == pytest.approx(1.5) and shares["b"].share == pytest.approx(0.5)
    explained = ledger.explain("b1")
    assert explained.state == "waiting"
    assert "fair key b weighs 1 and holds 0 slots" in explained.text, explained.text
    assert explained.facts["fair_weight"] == 1.0
    explained = ledger.explain("a2")
    assert "fair key a weighs 3 and holds 2 slots" in explained.text, explained.text
    assert "1 waiting fair key with a lower load goes first" in explained.text, explained.text


def test_a_parked_weighted_call_keeps_its_weight_through_a_voided_promotion(
    ledger: Ledger, engine: sa.Engine, clock: Callable[..., Any]
) -> None:
    """The call's weight is stored with the parked row and comes back with it when a promotion that was never bound
    is voided (D5: back in line with its arrival number)."""
    ledger.configure({"crm": NameConfig("crm", limit=1, fair=True)})
    gate = Gate(ledger)
    gate.admit("a0", "a")
    assert fair_arrive(ledger, "b0", "b", weight=4).verdict is Verdict.PARKED
    fence = gate.running.pop("a0")
    (promotion,) = ledger.release(Token("a0", 0), fence, Outcome.COMPLETED, now=clock()).promotions
    assert promotion.task_id == "b0"
    ledger.reclaim(now=clock() + timedelta(seconds=120))  # never bound: voided, back in line
    with engine.connect() as conn:  # back in line, or promoted again from its stored row
        weight = conn.execute(
            sa.text(
                "SELECT COALESCE((SELECT fair_weight FROM keyed_waiting WHERE task_id = 'b0'),"
                " (SELECT CAST(parked->>'fair_weight' AS double precision) FROM keyed_claims WHERE task_id = 'b0'))"
            )
        ).scalar()
    assert weight == 4.0


def test_the_weighted_share_is_of_the_keys_own_limit(ledger: Ledger) -> None:
    """A key with a limit of its own (a key override, 0014) shares that limit by weight."""
    ledger.configure({"crm": NameConfig("crm", limit=4, fair=True, fair_weights={"a": 3})})
    ledger.set_key_limit("crm:eu", 8, reason="bigger quota for eu")
    fair_arrive(ledger, "a0", "a")
    fair_arrive(ledger, "b0", "b")
    shares = {s.fair_key: s.share for s in ledger.fair_shares(key="crm:eu")}
    assert shares == {"a": pytest.approx(6.0), "b": pytest.approx(2.0)}


def test_the_fair_gauges_per_name_and_fair_key(ledger: Ledger, engine: sa.Engine) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from celery_keyed.metrics import LedgerCollector

    ledger.configure({"crm": NameConfig("crm", limit=2, fair=True, fair_weights={"a": 3})})
    for i in range(3):
        fair_arrive(ledger, f"a{i}", "a")
    fair_arrive(ledger, "b0", "b")
    registry = CollectorRegistry()
    registry.register(LedgerCollector(engine))
    samples = {
        (s.name, s.labels.get("fair_key")): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
        if s.name.startswith("celery_keyed_fair_")
    }
    assert samples == {
        ("celery_keyed_fair_in_flight", "a"): 2.0,
        ("celery_keyed_fair_in_flight", "b"): 0.0,
        ("celery_keyed_fair_waiting", "a"): 1.0,
        ("celery_keyed_fair_waiting", "b"): 1.0,
        ("celery_keyed_fair_weight", "a"): 3.0,
        ("celery_keyed_fair_weight", "b"): 1.0,
    }
