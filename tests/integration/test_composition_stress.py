"""Stress of several keys per attempt: threads with their own ledgers admit attempts that need a tenant key
(K = 2) and a shared gate (K = 3) at once, some weighted; an independent observer (counters under a lock,
incremented after admission committed, decremented before the release is sent) checks that no key ever has
more than its limit in flight, that both limits are reached, and that every attempt completes exactly once
with every counter back to zero and no drift (DESIGN §3.1, §3.10)."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict
from celery_keyed.ledger.reconcile import check_counters_once

LIMITS = {"t:0": 2, "t:1": 2, "t:2": 2, "gate": 3}


def test_multi_key_attempts_under_contention(engine: sa.Engine) -> None:
    Ledger(engine).configure({"gate": NameConfig("gate", limit=3), "t": NameConfig("t", limit=2)})
    lock = threading.Lock()
    in_flight: Counter[str] = Counter()
    peak: Counter[str] = Counter()
    done: Counter[str] = Counter()
    errors: list[BaseException] = []

    def run(ledger: Ledger, token: Token, fence: int, keys: tuple[str, ...], cost: int, rng: random.Random) -> Any:
        with lock:
            for k in keys:
                in_flight[k] += cost
                peak[k] = max(peak[k], in_flight[k])
        time.sleep(rng.uniform(0, 0.002))
        with lock:
            for k in keys:
                in_flight[k] -= cost
            done[token.task_id] += 1
        return ledger.release(token, fence, Outcome.COMPLETED).promotions

    def worker(index: int) -> None:
        rng = random.Random(index)
        ledger = Ledger(engine, lease=60)
        try:
            for cycle in range(60):
                tenant = f"t:{rng.randrange(3)}"
                keys = (tenant, "gate") if rng.random() < 0.7 else (tenant,)
                cost = 2 if keys == (tenant, "gate") and rng.random() < 0.2 else 1
                arrival = Arrival(
                    task_id=f"w{index}-{cycle}", key=keys[0], extra_keys=keys[1:], cost=cost, message={"k": keys}
                )
                admission = ledger.admit(arrival)
                pending = list(admission.promotions)
                if admission.verdict is Verdict.ADMITTED:
                    pending += run(ledger, arrival.token, admission.fence, keys, cost, rng)
                else:
                    assert admission.verdict is Verdict.PARKED, admission
                while pending:
                    p = pending.pop()
                    fence = ledger.bind(p.token, p.nonce)
                    if fence is not None:
                        pk = tuple(p.message["k"])
                        pending += run(ledger, p.token, fence, pk, _cost(engine, p.token), rng)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    # Whatever is still parked is started by the sweep (lock-order skips, promotions nobody bound here).
    ledger = Ledger(engine, lease=60)
    deadline = time.monotonic() + 120
    rng = random.Random(99)
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            left = conn.execute(sa.text("SELECT count(*) FROM keyed_tasks WHERE outcome IS NULL")).scalar_one()
        if not left:
            break
        report = ledger.sweep()
        pending = list(report.promotions)
        with engine.connect() as conn:
            promoted = conn.execute(
                sa.text("SELECT task_id, attempt, nonce FROM keyed_claims WHERE state = 'promoted'")
            ).all()
        for row in promoted:
            fence = ledger.bind(Token(row.task_id, row.attempt), row.nonce)
            if fence is not None:
                keys = tuple(_message(engine, row.task_id)["k"])
                pending += run(ledger, Token(row.task_id, row.attempt), fence, keys, _cost(engine, row.task_id), rng)
        while pending:
            p = pending.pop()
            fence = ledger.bind(p.token, p.nonce)
            if fence is not None:
                pending += run(ledger, p.token, fence, tuple(p.message["k"]), _cost(engine, p.token), rng)
    for key, limit in LIMITS.items():
        assert peak[key] <= limit, f"{key}: {peak[key]} in flight, limit {limit}"
    assert peak["gate"] >= 2  # it was really a gate (the bound itself is checked above)
    assert all(n == 1 for n in done.values())
    assert ledger.books()["completed"] == 360
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT coalesce(sum(used), 0) FROM keyed_slots")).scalar_one() == 0
        assert conn.execute(sa.text("SELECT count(*) FROM keyed_waiting")).scalar_one() == 0
    assert check_counters_once(engine) == []


def _cost(engine: sa.Engine, token: Any) -> int:
    task_id = token.task_id if isinstance(token, Token) else token
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT cost FROM keyed_claims WHERE task_id = :t"), {"t": task_id}).scalar())


def _message(engine: sa.Engine, task_id: str) -> Any:
    with engine.connect() as conn:
        parked = conn.execute(sa.text("SELECT parked FROM keyed_claims WHERE task_id = :t"), {"t": task_id}).scalar()
    return parked["message"]
