"""Stress: many OS processes hammer one sharded gate on real Postgres; an independent observer checks the bound.

N spawned processes (each with its own engine and ``Ledger``, so its own holder and connections) run M cycles
on the one key ``gate:hot`` (K = 3 over 2 shards). A cycle admits a new task; an admitted attempt is "run": the
observer counts it in flight, it holds for 0-2 ms, the observer counts it out, then it is released. A parked
attempt is not retried by its process: it gets a slot only by promotion, so whichever process's release returns
the promotion binds it and runs it as its own work (which may promote the next one) — the local handoff of D4.

The observer is not the ledger: a counter in shared memory, guarded by a lock, incremented only after the
admission (or bind) has committed and decremented before the release is sent. It therefore never sees more in
flight than the ledger really had, so ``max in flight > K`` would be a real breach of the bound (§3.1).
It must also reach K, so that the test fails if the gate were a mutex.

At the end every counter is back to zero, no claim or waiting row is left, and the books show every task
completed exactly once (§3.6).
"""

from __future__ import annotations

import multiprocessing
import queue
import random
import time
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, ReleaseRequest, Token, Verdict

KEY = "gate:hot"
LIMIT = 3
SHARDS = 2
HOLD_MAX = 0.002  # seconds an admitted attempt "works"
JOIN_TIMEOUT = 600.0  # seconds; generous, the slow variant takes about a minute on 2 cores


@dataclass(frozen=True)
class StressResult:
    seconds: float
    max_in_flight: int
    admitted: int  # attempts admitted at arrival
    parked: int  # attempts parked at arrival
    promoted: int  # promotions bound and run by the process whose release returned them
    released: int


def _worker(
    database_url: str,
    index: int,
    cycles: int,
    seed: int,
    in_flight: Any,
    peak: Any,
    lock: Any,
    results: Any,
    start: Any,
    batch: int = 1,
) -> None:
    """One process of the stress run (module level so that ``spawn`` can import it). ``batch`` > 1: arrivals come
    in batches of that many (``admit_many``) and the attempts admitted together end together (``release_many``)."""
    rng = random.Random(seed)
    engine = sa.create_engine(database_url, pool_size=1, max_overflow=0)
    ledger = Ledger(engine, lease=60)
    with engine.connect() as conn:  # connect before the start line, so all processes begin together
        conn.execute(sa.text("SELECT 1"))
    start.wait(timeout=60)
    counts = {"admitted": 0, "parked": 0, "promoted": 0, "released": 0, "unbound": 0, "not_released": 0}

    def run(held: list[tuple[Token, int]]) -> list[Any]:
        """Execute attempts that hold a slot, release them, and return the promotions the releases made."""
        with lock:
            in_flight.value += len(held)
            if in_flight.value > peak.value:
                peak.value = in_flight.value
        time.sleep(rng.uniform(0.0, HOLD_MAX))
        with lock:
            in_flight.value -= len(held)
        if batch > 1:
            reports = ledger.release_many([ReleaseRequest(t, f, Outcome.COMPLETED) for t, f in held])
        else:
            reports = [ledger.release(t, f, Outcome.COMPLETED) for t, f in held]
        for report in reports:
            counts["released" if report.released else "not_released"] += 1
        return [p for report in reports for p in report.promotions]

    try:
        for first in range(0, cycles, batch):
            arrivals = [
                Arrival(task_id=f"p{index}-c{cycle}", attempt=0, key=KEY, message={"p": index, "c": cycle})
                for cycle in range(first, min(first + batch, cycles))
            ]
            admissions = ledger.admit_many(arrivals) if batch > 1 else [ledger.admit(arrivals[0])]
            held = []
            pending = []
            for arrival, admission in zip(arrivals, admissions, strict=True):
                pending += list(admission.promotions)  # attempts ahead of it it started with the room it found
                if admission.verdict is Verdict.PARKED:
                    counts["parked"] += 1
                else:
                    assert admission.verdict is Verdict.ADMITTED, admission
                    assert admission.fence is not None
                    counts["admitted"] += 1
                    held.append((arrival.token, admission.fence))
            if held:
                pending += run(held)
            while pending:  # promotions this process was handed: bind and run them here (D4)
                promotion = pending.pop()
                fence = ledger.bind(promotion.token, promotion.nonce)
                if fence is None:
                    counts["unbound"] += 1
                    continue
                counts["promoted"] += 1
                pending += run([(promotion.token, fence)])
    finally:
        engine.dispose()
    results.put((index, counts))


def _deadlocks(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
        return int(
            conn.execute(
                sa.text("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
            ).scalar_one()
        )


def stress(database_url: str, processes: int, cycles: int, *, batch: int = 1) -> StressResult:
    """Run the stress workload on a migrated database and check every invariant; what was observed."""
    engine = sa.create_engine(database_url)
    try:
        Ledger(engine).configure({"gate": NameConfig("gate", limit=LIMIT, shards=SHARDS)})
        deadlocks_before = _deadlocks(engine)
    finally:
        engine.dispose()

    ctx = multiprocessing.get_context("spawn")
    in_flight = ctx.Value("i", 0, lock=False)
    peak = ctx.Value("i", 0, lock=False)
    lock = ctx.Lock()
    results = ctx.Queue()
    start = ctx.Barrier(processes)
    workers = [
        ctx.Process(
            target=_worker,
            args=(database_url, i, cycles, 1000 + i, in_flight, peak, lock, results, start, batch),
            name=f"stress-{i}",
        )
        for i in range(processes)
    ]
    started = time.monotonic()
    for w in workers:
        w.start()
    counts: dict[int, dict[str, int]] = {}
    try:
        deadline = started + JOIN_TIMEOUT
        while len(counts) < processes:
            if any(w.exitcode not in (None, 0) for w in workers):
                break
            try:
                index, c = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    break
                continue
            counts[index] = c
        for w in workers:
            w.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for w in workers:
            if w.is_alive():
                w.terminate()
                w.join(5)
    seconds = time.monotonic() - started
    assert [w.exitcode for w in workers] == [0] * processes, "a stress process failed (see its traceback above)"
    assert len(counts) == processes

    total = processes * cycles
    admitted = sum(c["admitted"] for c in counts.values())
    parked = sum(c["parked"] for c in counts.values())
    promoted = sum(c["promoted"] for c in counts.values())
    released = sum(c["released"] for c in counts.values())
    assert sum(c["unbound"] for c in counts.values()) == 0, "a promotion handed to its releaser did not bind"
    assert sum(c["not_released"] for c in counts.values()) == 0, "a release of a held claim released nothing"
    assert admitted + parked == total

    # The independent observer: never more than K in flight, and K was reached (the gate is not a mutex).
    assert in_flight.value == 0
    assert peak.value <= LIMIT, f"observed {peak.value} attempts in flight under {KEY} with K = {LIMIT}"
    assert peak.value == LIMIT, f"only {peak.value} in flight at most: the gate behaved like K = {peak.value}"

    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as conn:
            leftover_waiting = conn.execute(sa.text("SELECT task_id FROM keyed_waiting ORDER BY arrival")).scalars()
            leftover_waiting = list(leftover_waiting)
            leftover_claims = list(conn.execute(sa.text("SELECT task_id, state FROM keyed_claims")).all())
            used = conn.execute(sa.text("SELECT COALESCE(sum(used), 0) FROM keyed_slots")).scalar_one()
            waiting = conn.execute(sa.text("SELECT COALESCE(sum(waiting), 0) FROM keyed_keys")).scalar_one()
            shards = conn.execute(sa.text("SELECT count(*) FROM keyed_slots WHERE key = :k"), {"k": KEY}).scalar()
        books = Ledger(engine).books()
        deadlocks = _deadlocks(engine) - deadlocks_before
    finally:
        engine.dispose()
    # Ledger.transaction retries deadlocks silently: count them. The lock order (ledger/admit.py) allows none.
    assert deadlocks == 0, f"{deadlocks} deadlocks detected by Postgres during the run"
    # Every parked attempt was handed off by a release (no lost wakeup, D2/D4): nothing is stranded.
    assert leftover_waiting == [], f"{len(leftover_waiting)} parked attempts stranded: {leftover_waiting[:5]}"
    assert leftover_claims == []
    assert (used, waiting) == (0, 0)
    assert shards == SHARDS
    assert promoted == parked
    assert released == total
    assert books == {"completed": total, "arrivals": total}, books
    return StressResult(seconds, peak.value, admitted, parked, promoted, released)


def test_stress_hot_gate_small(database_url: str) -> None:
    """4 processes x 150 cycles on one gate, K = 3, 2 shards (the default suite's version)."""
    result = stress(database_url, processes=4, cycles=150)
    assert result.parked > 0, "no attempt was ever parked: the run did not contend"


def test_stress_hot_gate_batched(database_url: str) -> None:
    """The same with arrivals in batches of 3 (admit_many) and the attempts admitted together released together
    (release_many)."""
    result = stress(database_url, processes=4, cycles=150, batch=3)
    assert result.parked > 0, "no attempt was ever parked: the run did not contend"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stress_hot_gate_large(database_url: str) -> None:
    """8 processes x 1000 cycles on one gate, K = 3, 2 shards."""
    result = stress(database_url, processes=8, cycles=1000)
    assert result.parked > 0
