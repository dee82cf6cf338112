"""Debounce per key (issue 14 item 2) on real Postgres: a burst of arrivals of one key becomes one run after its
quiet period (keep last or keep first), bounded by debounce_max; the others are recorded superseded, and the books
balance. Time is passed to every call (``now=``): nothing sleeps."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict


def _arrive(ledger: Ledger, task_id: str, now: Any, *, key: str = "search:7", **options: Any) -> Any:
    options.setdefault("debounce", 5.0)
    return ledger.admit(
        Arrival(task_id, key=key, task_name="proj.reindex", message={"id": task_id}, **options), now=now
    )


def _run(ledger: Ledger, promotions: Any, now: Any) -> list[str]:
    """Bind and complete every promotion; the task ids that ran, in order."""
    ran = []
    for p in promotions:
        fence = ledger.bind(p.token, p.nonce, now=now)
        assert fence is not None
        ran.append(p.task_id)
        ledger.release(p.token, fence, Outcome.COMPLETED, now=now)
    return ran


def test_a_burst_runs_once_with_the_last_arguments_after_the_quiet_period(ledger: Ledger, clock) -> None:
    t0 = clock()
    verdicts = []
    for i, t in enumerate("abcde"):  # one arrival a second: never 5 s of quiet
        admission = _arrive(ledger, t, t0 + timedelta(seconds=i))
        verdicts.append(admission.verdict)
        assert admission.debounced
        if i:
            assert admission.superseded == ("abcde"[i - 1],)
    assert verdicts == [Verdict.PARKED] * 5  # a free slot does not start a debounced arrival
    # due 5 s after the last arrival (t0 + 4): nothing before
    assert ledger.sweep(now=t0 + timedelta(seconds=8.9)).promotions == []
    report = ledger.sweep(now=t0 + timedelta(seconds=9))
    assert [p.task_id for p in report.promotions] == ["e"]
    assert report.promotions[0].message == {"id": "e"}
    assert _run(ledger, report.promotions, t0 + timedelta(seconds=9)) == ["e"]
    assert ledger.books() == {"superseded": 4, "completed": 1, "arrivals": 5}


def test_keep_first_runs_the_first_arguments_and_the_quiet_period_counts_from_the_last_arrival(
    ledger: Ledger, clock
) -> None:
    t0 = clock()
    first = _arrive(ledger, "a", t0, debounce_keep="first")
    assert first.verdict is Verdict.PARKED
    for i, t in enumerate("bcd", start=1):
        admission = _arrive(ledger, t, t0 + timedelta(seconds=i), debounce_keep="first")
        assert admission.verdict is Verdict.SUPERSEDED and admission.debounced
        assert "a runs instead" in admission.detail
    assert ledger.explain("a", now=t0 + timedelta(seconds=4)).text.startswith("debounced until")
    assert ledger.sweep(now=t0 + timedelta(seconds=7.9)).promotions == []  # due at 3 + 5
    report = ledger.sweep(now=t0 + timedelta(seconds=8))
    assert [(p.task_id, p.message) for p in report.promotions] == [("a", {"id": "a"})]
    _run(ledger, report.promotions, t0 + timedelta(seconds=8))
    assert ledger.books() == {"superseded": 3, "completed": 1, "arrivals": 4}


def test_debounce_max_bounds_the_wait_under_a_continuous_stream(ledger: Ledger, clock) -> None:
    """An arrival every second with a 5 s quiet period never goes quiet: the burst starts 30 s after its first
    arrival (debounce_max), with the arguments of the latest arrival then; the stream goes on as a new burst."""
    t0 = clock()
    ran: list[tuple[float, str]] = []
    for i in range(45):
        now = t0 + timedelta(seconds=i)
        for p in ledger.sweep(now=now).promotions:  # the sweep runs before each arrival
            ran += [(float(i), t) for t in _run(ledger, [p], now)]
        _arrive(ledger, f"t{i}", now, debounce_max=30.0)
    assert ran == [(30.0, "t29")]  # the cap of the first burst: t0 + 30
    books = ledger.books()
    assert books["completed"] == 1 and books["arrivals"] == 45
    assert books["superseded"] == 45 - 1 - 1  # all but the one that ran and the one still waiting
    assert books["open"] == 1  # the second burst's survivor, still waiting: the books balance


def test_a_due_burst_waits_for_a_slot_and_a_new_arrival_opens_a_new_burst(ledger: Ledger, clock) -> None:
    """A debounced run waits for a slot like any other task (the bound holds); once due, its burst is closed."""
    t0 = clock()
    holder = ledger.admit(Arrival("busy", key="search:7"), now=t0)  # a plain task holds the mutex
    assert holder.verdict is Verdict.ADMITTED
    _arrive(ledger, "a", t0)
    assert ledger.sweep(now=t0 + timedelta(seconds=5)).promotions == []  # due, but no room: in line
    b = _arrive(ledger, "b", t0 + timedelta(seconds=6))
    assert b.verdict is Verdict.PARKED and b.superseded == ()  # a new burst: "a" keeps its place in line
    promotions = ledger.release(Token("busy", 0), holder.fence, Outcome.COMPLETED, now=t0 + timedelta(seconds=7))
    assert [p.task_id for p in promotions.promotions] == ["a"]
    _run(ledger, promotions.promotions, t0 + timedelta(seconds=7))
    report = ledger.sweep(now=t0 + timedelta(seconds=11))
    assert _run(ledger, report.promotions, t0 + timedelta(seconds=11)) == ["b"]
    assert ledger.books() == {"completed": 3, "arrivals": 3}


def test_a_debounced_key_with_several_slots_runs_one_per_burst_and_per_debounce_key(ledger: Ledger, clock) -> None:
    """K = 3: debouncing is per key and per debounce key (the supersede key, else the task name), not per slot."""
    t0 = clock()
    ledger.configure({"search": NameConfig("search", limit=3)}, now=t0)
    for i in range(4):
        now = t0 + timedelta(seconds=i)
        _arrive(ledger, f"x{i}", now, supersede_key="doc:x")
        _arrive(ledger, f"y{i}", now, supersede_key="doc:y")
        _arrive(ledger, f"o{i}", now, key="search:8")  # another key: its own burst
    assert ledger.admit(Arrival("plain", key="search:7"), now=t0).verdict is Verdict.ADMITTED  # not debounced
    report = ledger.sweep(now=t0 + timedelta(seconds=8))
    assert sorted(p.task_id for p in report.promotions) == ["o3", "x3", "y3"]
    assert sorted(_run(ledger, report.promotions, t0 + timedelta(seconds=8))) == ["o3", "x3", "y3"]
    books = ledger.books()
    assert books == {"superseded": 9, "completed": 3, "open": 1, "arrivals": 13}  # "plain" is still running


def test_the_waiting_room_counts_one_place_per_burst(ledger: Ledger, clock, scalar) -> None:
    t0 = clock()
    ledger.configure({"search": NameConfig("search", limit=1, max_waiting=1)}, now=t0)
    for i in range(5):
        assert _arrive(ledger, f"t{i}", t0 + timedelta(seconds=i)).verdict is Verdict.PARKED
    assert scalar("SELECT waiting FROM keyed_keys WHERE key = 'search:7'") == 1
    assert scalar("SELECT count(*) FROM keyed_waiting") == 1
    # another debounce key finds the room full
    assert _arrive(ledger, "other", t0 + timedelta(seconds=5), supersede_key="x").verdict is Verdict.REJECTED


def test_explain_says_debounced_until(ledger: Ledger, clock) -> None:
    t0 = clock()
    _arrive(ledger, "a", t0, debounce_max=60.0)
    explanation = ledger.explain("a", now=t0 + timedelta(seconds=1))
    assert explanation.state == "debounced"
    assert explanation.text.startswith("debounced until ")
    assert "at the latest" in explanation.text


def test_two_arrivals_of_one_burst_at_once_leave_exactly_one(engine: sa.Engine, clock) -> None:
    """Race: two arrivals of one key and debounce key, each in its own thread and transaction, released together
    many times over; each time exactly one waits and the other is superseded, and the room counts one."""
    t0 = clock()
    for round_ in range(20):
        key = f"search:race{round_}"
        barrier = threading.Barrier(2)
        verdicts: list[Any] = []

        def arrive(
            task_id: str, key: str = key, barrier: threading.Barrier = barrier, verdicts: list[Any] = verdicts
        ) -> None:
            own = Ledger(engine, holder=f"h-{task_id}:1:aa", lease=30.0)
            barrier.wait()
            verdicts.append(_arrive(own, task_id, t0, key=key))

        threads = [threading.Thread(target=arrive, args=(f"{key}-{n}",)) for n in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert [v.verdict for v in verdicts] == [Verdict.PARKED, Verdict.PARKED]
        assert sum(len(v.superseded) for v in verdicts) == 1
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM keyed_waiting WHERE key = :k"), {"k": key}).scalar() == 1
            assert conn.execute(sa.text("SELECT waiting FROM keyed_keys WHERE key = :k"), {"k": key}).scalar() == 1
    ledger = Ledger(engine, holder="test-host:1:aaaa", lease=30.0)
    assert ledger.books() == {"superseded": 20, "open": 20, "arrivals": 40}


def test_two_keep_first_arrivals_at_once_leave_exactly_one(engine: sa.Engine, clock) -> None:
    t0 = clock()
    for round_ in range(10):
        key = f"search:first{round_}"
        barrier = threading.Barrier(2)
        verdicts: list[Any] = []

        def arrive(
            task_id: str, key: str = key, barrier: threading.Barrier = barrier, verdicts: list[Any] = verdicts
        ) -> None:
            own = Ledger(engine, holder=f"h-{task_id}:1:aa", lease=30.0)
            barrier.wait()
            verdicts.append(_arrive(own, task_id, t0, key=key, debounce_keep="first").verdict)

        threads = [threading.Thread(target=arrive, args=(f"{key}-{n}",)) for n in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert sorted(verdicts) == sorted([Verdict.PARKED, Verdict.SUPERSEDED])
    assert Ledger(engine, holder="x:1:aa").books() == {"superseded": 10, "open": 10, "arrivals": 20}


def test_a_redelivered_debounced_arrival_is_a_duplicate(ledger: Ledger, clock) -> None:
    t0 = clock()
    _arrive(ledger, "a", t0)
    again = _arrive(ledger, "a", t0 + timedelta(seconds=1))
    assert again.verdict is Verdict.DUPLICATE
    assert ledger.books() == {"open": 1, "arrivals": 1}


def test_debounce_options_are_checked() -> None:
    import pytest

    for bad in ({"debounce": 0}, {"debounce": -1.0}, {"debounce": True}, {"debounce": 5.0, "debounce_max": 1.0},
                {"debounce": 5.0, "debounce_keep": "middle"}):
        with pytest.raises(ValueError):
            Arrival("a", key="search:1", **bad)
    with pytest.raises(ValueError):
        Arrival("a", key="search:1", group_key="g:1", debounce=1.0)
    assert Arrival("a", key="search:1", debounce=5.0).debounce_max == 60.0
    assert Arrival("a", key="search:1", debounce=90.0).debounce_max == 90.0


def test_an_arrival_never_waits_for_a_burst_another_transaction_is_closing(
    ledger: Ledger, engine: sa.Engine, clock
) -> None:
    """Race: the sweep (here: a connection holding the row, as WAITING_CLEAR_DUE does when it makes the row due) has
    the open burst's row locked; an arrival of the key does not wait for it (SKIP LOCKED) and opens a new burst. The
    held row is left to its holder; the books balance either way."""
    t0 = clock()
    ledger.configure({"search": NameConfig("search", limit=2)}, now=t0)
    _arrive(ledger, "a", t0)
    with engine.connect() as holder:
        holder.execute(sa.text("SELECT 1 FROM keyed_waiting WHERE task_id = 'a' FOR UPDATE"))
        started = time.monotonic()
        b = _arrive(ledger, "b", t0 + timedelta(seconds=1))
        assert time.monotonic() - started < 2.0  # did not wait for the lock
        assert b.verdict is Verdict.PARKED and b.superseded == ()
        holder.rollback()
    report = ledger.sweep(now=t0 + timedelta(seconds=6))
    assert sorted(_run(ledger, report.promotions, t0 + timedelta(seconds=6))) == ["a", "b"]
    assert ledger.books() == {"completed": 2, "arrivals": 2}
