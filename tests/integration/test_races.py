"""Forced race orderings on real Postgres.

Each test opens two connections, runs one side of the race in an open transaction (holding its row locks),
starts the other side in a thread, waits until Postgres reports that thread's backend blocked on a lock, then
commits the first side and checks who won and the final counts. No sleeps decide the order: the lock wait
observed in ``pg_stat_activity`` does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict, admit, overrides, release
from celery_keyed.ledger.reconcile import check_counters_once, reclaim_once

HOLDER = "race:1:aaaa"
LEASE = 30.0


class Side(threading.Thread):
    """Run ``work(conn)`` in its own transaction on its own connection; remember its backend pid."""

    def __init__(self, engine: sa.Engine, work: Callable[[sa.Connection], Any]) -> None:
        super().__init__(daemon=True)
        self.engine = engine
        self.work = work
        self.pid: int | None = None
        self.ready = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.engine.connect() as conn:
                self.pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
                conn.commit()
                self.ready.set()
                with conn.begin():
                    self.result = self.work(conn)
        except BaseException as exc:  # reported by finish()
            self.error = exc
            self.ready.set()

    def finish(self) -> Any:
        self.join(timeout=30)
        assert not self.is_alive(), "the second side never finished"
        if self.error is not None:
            raise self.error
        return self.result


def wait_until_blocked(engine: sa.Engine, side: Side, timeout: float = 10.0) -> None:
    """Return once Postgres shows ``side``'s backend waiting for a lock."""
    assert side.ready.wait(timeout)
    deadline = time.monotonic() + timeout
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            waiting = conn.execute(
                sa.text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :pid"),
                {"pid": side.pid},
            ).scalar()
            if waiting:
                return
            if not side.is_alive():
                side.finish()
                pytest.fail("the second side finished without waiting for the first side's lock")
            conn.rollback()
            time.sleep(0.005)
    pytest.fail("the second side never blocked on the first side's lock")


def count(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


@pytest.fixture
def ledger(engine: sa.Engine) -> Ledger:
    return Ledger(engine, holder=HOLDER, lease=LEASE)


def test_release_racing_the_reaper_exactly_one_wins(engine: sa.Engine, ledger: Ledger, clock) -> None:
    adm = ledger.admit(Arrival("a", key="k:1"), now=clock())
    clock.advance(LEASE + 1)  # the lease lapsed: the reaper may take the row, the worker still releases
    with engine.connect() as conn, conn.begin():
        assert release.release(conn, Token("a", 0), adm.fence, Outcome.COMPLETED, now=clock()).released
        reaper = Side(engine, lambda c: reclaim_once(engine, lease=LEASE, now=clock()))
        reaper.start()
        _wait_for_lock_waiter(engine)  # the reaper's DELETE waits for the worker's
    assert reaper.finish().reclaimed == []  # the loser does nothing
    assert count(engine, "SELECT used FROM keyed_slots WHERE key = 'k:1'") == 0
    assert ledger.books() == {"completed": 1, "arrivals": 1}


def test_reaper_racing_the_release_exactly_one_wins(engine: sa.Engine, ledger: Ledger, clock) -> None:
    adm = ledger.admit(Arrival("a", key="k:1"), now=clock())
    clock.advance(LEASE + 1)
    with engine.connect() as conn, conn.begin():
        row = conn.execute(
            sa.text("DELETE FROM keyed_claims WHERE task_id = 'a' RETURNING task_id, attempt, key, shard, group_key")
        ).one()  # the reaper's DELETE, not committed yet
        worker = Side(engine, lambda c: release.release(c, Token("a", 0), adm.fence, Outcome.COMPLETED, now=clock()))
        worker.start()
        wait_until_blocked(engine, worker)
        release.after_claim_removed(conn, row, Outcome.WORKER_LOST, detail="", dispatch=10, now=clock())
    assert not worker.finish().released  # the stale worker's release is a no-op
    assert count(engine, "SELECT used FROM keyed_slots WHERE key = 'k:1'") == 0
    assert ledger.books() == {"open": 1, "arrivals": 1}  # worker lost: the redelivery will run it


def test_admit_waits_for_release_and_takes_the_freed_slot(engine: sa.Engine, ledger: Ledger) -> None:
    """Release first (holding its shard row), admission second: the arrival must be admitted, not parked
    next to a free slot (D2)."""
    holder = ledger.admit(Arrival("a", key="k:1"))
    with engine.connect() as conn, conn.begin():
        report = release.release(conn, Token("a", 0), holder.fence, Outcome.COMPLETED)
        assert report.promotions == []  # nobody is waiting yet
        arrival = Side(engine, lambda c: admit.admit(c, Arrival("b", key="k:1"), holder=HOLDER, lease=LEASE))
        arrival.start()
        wait_until_blocked(engine, arrival)  # the fast path skipped the locked row; the slow path waits for it
    assert arrival.finish().verdict is Verdict.ADMITTED
    assert count(engine, "SELECT used FROM keyed_slots WHERE key = 'k:1'") == 1


def test_release_waits_for_park_and_promotes_the_parked(engine: sa.Engine, ledger: Ledger) -> None:
    """Park first (holding every shard row of the key), release second: the release must see the parked
    attempt and promote it — no attempt is stranded with used = 0 (D2)."""
    holder = ledger.admit(Arrival("a", key="k:1"))
    with engine.connect() as conn, conn.begin():
        parked = admit.admit(conn, Arrival("b", key="k:1"), holder=HOLDER, lease=LEASE)
        assert parked.verdict is Verdict.PARKED
        releaser = Side(engine, lambda c: release.release(c, Token("a", 0), holder.fence, Outcome.COMPLETED))
        releaser.start()
        wait_until_blocked(engine, releaser)
    report = releaser.finish()
    assert [p.task_id for p in report.promotions] == ["b"]
    assert count(engine, "SELECT used FROM keyed_slots WHERE key = 'k:1'") == 1
    assert count(engine, "SELECT count(*) FROM keyed_waiting") == 0


def test_reconcile_racing_a_claim_does_not_overwrite_the_count(engine: sa.Engine, ledger: Ledger) -> None:
    """Reconcile locks the key row first, then counts claims in a later statement (D1): a claim that was
    in flight when reconcile started is counted, not overwritten."""
    ledger.configure({"g": NameConfig("g", limit=5)})
    ledger.admit(Arrival("a", key="g:1"))
    with engine.connect() as conn, conn.begin():
        assert admit.admit(conn, Arrival("b", key="g:1"), holder=HOLDER, lease=LEASE).admitted
        checker = Side(engine, lambda c: check_counters_once(engine))
        checker.start()
        _wait_for_lock_waiter(engine)  # reconcile's row lock waits for the claim's transaction
    assert checker.finish() == []  # no drift reported
    assert count(engine, "SELECT used FROM keyed_slots WHERE key = 'g:1'") == 2
    assert count(engine, "SELECT count(*) FROM keyed_claims") == 2


def test_override_lowered_while_claims_are_in_flight(engine: sa.Engine, ledger: Ledger) -> None:
    """Lowering K never preempts; it only stops new claims until in-flight < K (§3.7). The override commits
    while an admission waits for it: the admission reads the new limit."""
    ledger.configure({"g": NameConfig("g", limit=3)})
    held = [ledger.admit(Arrival(t, key="g:1")) for t in "ab"]
    with engine.connect() as conn, conn.begin():
        overrides.set_override(conn, "g", 1, reason="incident")
        # The override row is locked until commit; an admission evaluates the limit after it commits.
        conn.execute(sa.text("SELECT 1 FROM keyed_slots WHERE key = 'g:1' FOR UPDATE"))
        arrival = Side(engine, lambda c: admit.admit(c, Arrival("c", key="g:1"), holder=HOLDER, lease=LEASE))
        arrival.start()
        wait_until_blocked(engine, arrival)
    assert arrival.finish().verdict is Verdict.PARKED
    assert count(engine, "SELECT count(*) FROM keyed_claims") == 2  # nobody was preempted
    assert ledger.release(Token("a", 0), held[0].fence, Outcome.COMPLETED).promotions == []  # 1 in flight ≥ 1
    (p,) = ledger.release(Token("b", 0), held[1].fence, Outcome.COMPLETED).promotions
    assert p.task_id == "c"


def test_override_in_the_callers_transaction_rolls_back_with_it(engine: sa.Engine, ledger: Ledger) -> None:
    ledger.configure({"g": NameConfig("g", limit=3)})
    with pytest.raises(RuntimeError), engine.begin() as conn:
        overrides.set_override(conn, "g", 0, reason="pause with my own work")
        conn.execute(sa.text("CREATE TEMP TABLE my_work (x int)"))
        raise RuntimeError("the caller's work failed")
    assert ledger.admit(Arrival("a", key="g:1")).admitted  # not paused
    with engine.begin() as conn:
        overrides.set_override(conn, "g", 0, reason="pause with my own work")
    assert ledger.admit(Arrival("b", key="g:1")).verdict is Verdict.PARKED


def test_concurrent_duplicates_of_one_attempt_admit_once(engine: sa.Engine, ledger: Ledger) -> None:
    """Two deliveries of the same attempt at once (D8): the second waits for the first's task row and then
    sees its claim."""
    with engine.connect() as conn, conn.begin():
        first = admit.admit(conn, Arrival("a", key="k:1"), holder=HOLDER, lease=LEASE)
        assert first.admitted
        second = Side(engine, lambda c: admit.admit(c, Arrival("a", key="k:1"), holder="other:2:bbbb", lease=LEASE))
        second.start()
        wait_until_blocked(engine, second)
    assert second.finish().verdict is Verdict.DUPLICATE
    assert count(engine, "SELECT count(*) FROM keyed_claims") == 1


def _wait_for_lock_waiter(engine: sa.Engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            n = conn.execute(
                sa.text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
            ).scalar_one()
            if n:
                return
            conn.rollback()
            time.sleep(0.005)
    pytest.fail("nobody blocked on a lock")


def test_a_newcomer_never_takes_a_freed_slot_ahead_of_the_line(engine: sa.Engine, ledger: Ledger) -> None:
    """Between an autocommitted release and its promotion the slot is free; an arrival in that window parks
    behind the waiting attempt instead of jumping the line (FIFO, D10), on both admission paths."""
    a = ledger.admit(Arrival("a", key="k:1"))
    assert ledger.admit(Arrival("b", key="k:1")).verdict is Verdict.PARKED
    with ledger.autocommit.connect() as conn:
        _report, rest = release.release_autocommit(conn, Token("a", 0), a.fence, Outcome.COMPLETED)
    assert rest is not None  # the key has a waiter: the promotion is still to do
    assert count(engine, "SELECT used FROM keyed_slots WHERE key = 'k:1'") == 0
    late = ledger.admit(Arrival("c", key="k:1"))  # the fast path refuses; the slow path parks it behind b ...
    assert late.verdict is Verdict.PARKED and [p.task_id for p in late.promotions] == ["b"]  # ... and starts b
    with engine.begin() as conn:  # the slow path, called directly: nothing left to start
        slow = admit.admit(conn, Arrival("d", key="k:1"), holder=HOLDER, lease=LEASE)
    assert slow.verdict is Verdict.PARKED and slow.promotions == ()
    waited, key, has_shadow = rest
    promoted = ledger.transaction(
        lambda conn: release.after_release_autocommit(conn, Token("a", 0), waited, key, has_shadow, Outcome.COMPLETED)
    )
    assert promoted == []  # b started already: one slot, one promotion
