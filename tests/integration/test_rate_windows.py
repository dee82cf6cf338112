"""Rate windows per key on real Postgres: at most N starts of a key in any window of T seconds, for every window of
its name, beside or instead of its token bucket; a start debits every window (and the bucket, and the gate) or none;
an attempt a window refuses parks with the time the window frees (no polling); a quota outlives the key's idle row;
reconcile forgets windows nothing can count any more; status and explain show them."""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import timedelta

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict
from celery_keyed.ledger.reconcile import check_counters_once, drop_idle_keys_once
from celery_keyed.ledger.status import status_names
from celery_keyed.ledger.windows import prune, usage


def arrive(ledger: Ledger, task_id: str, *keys: str, cost: int = 1, now=None):
    return ledger.admit(
        Arrival(task_id=task_id, key=keys[0], extra_keys=tuple(keys[1:]), cost=cost, message={"id": task_id}),
        now=now,
    )


def used(scalar: Callable[..., object], key: str) -> int:
    return int(scalar("SELECT COALESCE(sum(used), 0) FROM keyed_slots WHERE key = :key", key=key) or 0)


def not_before(scalar: Callable[..., object], task_id: str, now) -> float:
    return float(scalar("SELECT extract(epoch FROM not_before - :now) FROM keyed_waiting WHERE task_id = :t",
                        t=task_id, now=now))


def positions(scalar: Callable[..., object], key: str) -> int:
    return int(scalar("SELECT COALESCE((SELECT next_pos FROM keyed_windows WHERE key = :key), 0)", key=key))


def test_two_windows_each_bind_and_park_with_the_time_their_start_leaves(ledger: Ledger, clock, scalar) -> None:
    """2 per second and 3 per 10 s: the short window parks the third start for a second, the long one the fourth
    until the first start is 10 s old; each parked with that time, promoted by the sweep then and not before."""
    ledger.configure({"q": NameConfig("q", limit=10, windows=("2/s", (3, 10)))}, now=clock())
    t0 = clock()
    assert [arrive(ledger, t, "q:x", now=clock()).verdict for t in "abc"] == [
        Verdict.ADMITTED, Verdict.ADMITTED, Verdict.PARKED]
    assert 0.99 < not_before(scalar, "c", t0) < 1.01
    assert ledger.sweep(now=clock.advance(0.9)).promotions == []
    assert [p.task_id for p in ledger.sweep(now=clock.advance(0.1)).promotions] == ["c"]  # t = 1.0
    assert arrive(ledger, "d", "q:x", now=clock()).verdict is Verdict.PARKED  # 3 starts in the last 10 s
    assert 8.99 < not_before(scalar, "d", clock()) < 9.01  # the first start (t = 0) leaves the 10 s window at 10
    assert ledger.sweep(now=clock.advance(8.9)).promotions == []
    assert [p.task_id for p in ledger.sweep(now=clock.advance(0.1)).promotions] == ["d"]  # t = 10
    assert used(scalar, "q:x") == 4 and check_counters_once(ledger.engine) == []  # two run, two promoted


def test_a_start_debits_the_bucket_the_windows_and_the_gate_or_none(ledger: Ledger, clock, scalar) -> None:
    ledger.configure({"api": NameConfig("api", limit=1, rate=10.0, burst=5, windows=[(2, 60)])}, now=clock())
    a = arrive(ledger, "a", "api:x", now=clock())
    assert a.verdict is Verdict.ADMITTED
    assert scalar("SELECT tokens FROM keyed_keys WHERE key = 'api:x'") == 4 and positions(scalar, "api:x") == 1
    assert arrive(ledger, "b", "api:x", now=clock()).verdict is Verdict.PARKED  # the gate (K = 1) refuses
    assert scalar("SELECT tokens FROM keyed_keys WHERE key = 'api:x'") == 4 and positions(scalar, "api:x") == 1
    (b,) = ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED, now=clock()).promotions  # the second position
    assert positions(scalar, "api:x") == 2 and scalar("SELECT tokens FROM keyed_keys WHERE key = 'api:x'") == 3
    # the window (2 per minute) is full: the next start takes neither a slot nor a token
    b_fence = ledger.bind(b.token, b.nonce, now=clock())
    ledger.release(Token("b", 0), b_fence, Outcome.COMPLETED, now=clock())
    assert arrive(ledger, "c", "api:x", now=clock()).verdict is Verdict.PARKED
    assert used(scalar, "api:x") == 0 and positions(scalar, "api:x") == 2
    assert scalar("SELECT tokens FROM keyed_keys WHERE key = 'api:x'") == 3
    assert 59.9 < not_before(scalar, "c", clock()) < 60.1


def test_a_multi_key_attempt_takes_a_window_only_with_its_other_keys(ledger: Ledger, clock, scalar) -> None:
    ledger.configure({"quota": NameConfig("quota", limit=5, windows=["1/m"])}, now=clock())
    held = arrive(ledger, "held", "acct:1", now=clock())  # acct:1 (a mutex) is full
    assert arrive(ledger, "m", "acct:1", "quota:1", now=clock()).verdict is Verdict.PARKED
    assert positions(scalar, "quota:1") == 0 and used(scalar, "quota:1") == 0  # the window was not debited
    report = ledger.release(Token("held", 0), held.fence, Outcome.COMPLETED, now=clock())
    assert [p.task_id for p in report.promotions] == ["m"]
    assert positions(scalar, "quota:1") == 1 and used(scalar, "acct:1") == 1 and used(scalar, "quota:1") == 1
    # the window now refuses: a second multi-key attempt holds nothing of acct:2 either
    assert arrive(ledger, "n", "acct:2", "quota:1", now=clock()).verdict is Verdict.PARKED
    assert used(scalar, "acct:2") == 0 and positions(scalar, "quota:1") == 1
    assert [p.task_id for p in ledger.sweep(now=clock.advance(60)).promotions] == ["n"]
    assert used(scalar, "acct:2") == 1 and check_counters_once(ledger.engine) == []


def test_a_cost_takes_that_many_starts_and_a_cost_no_window_allows_is_rejected(ledger: Ledger, clock, scalar) -> None:
    ledger.configure({"q": NameConfig("q", limit=10, windows=[(3, 60), (5, 3600)])}, now=clock())
    assert arrive(ledger, "a", "q:x", cost=2, now=clock()).verdict is Verdict.ADMITTED
    assert positions(scalar, "q:x") == 2
    assert arrive(ledger, "b", "q:x", cost=2, now=clock()).verdict is Verdict.PARKED  # 2 + 2 > 3 in a minute
    assert positions(scalar, "q:x") == 2
    heavy = arrive(ledger, "heavy", "q:x", cost=4, now=clock())
    assert heavy.verdict is Verdict.REJECTED and "rate window" in heavy.detail
    assert [p.task_id for p in ledger.sweep(now=clock.advance(60)).promotions] == ["b"]
    assert positions(scalar, "q:x") == 4
    # the hour allows one more start: a cost of 2 waits for the first start to be an hour old
    assert arrive(ledger, "c", "q:x", cost=2, now=clock.advance(60)).verdict is Verdict.PARKED
    assert 3479 < not_before(scalar, "c", clock()) < 3481


@pytest.mark.parametrize("limits", [{"windows": [(2, 60)]}, {"rate": 1 / 30, "burst": 2}], ids=["windows", "bucket"])
def test_a_retry_and_a_redelivery_start_again_and_take_from_the_rate(ledger: Ledger, clock, limits) -> None:
    """A later attempt (a retry) or the same attempt delivered again after its worker was lost is a start like any
    other: with the rate spent it parks instead of taking the fast claim of later attempts."""
    ledger.configure({"q": NameConfig("q", limit=5, **limits)}, now=clock())
    a = arrive(ledger, "a", "q:x", now=clock())
    b = arrive(ledger, "b", "q:x", now=clock())
    assert a.admitted and b.admitted
    ledger.release(Token("a", 0), a.fence, Outcome.RETRY, now=clock())
    retry = ledger.admit(Arrival(task_id="a", attempt=1, key="q:x", message={}), now=clock())
    assert retry.verdict is Verdict.PARKED
    ledger.release(Token("b", 0), b.fence, Outcome.WORKER_LOST, uncertain=True, now=clock())
    again = ledger.admit(Arrival(task_id="b", key="q:x", message={}), now=clock())
    assert again.verdict is Verdict.PARKED
    promoted = [p.task_id for p in ledger.sweep(now=clock.advance(60)).promotions]
    assert promoted == ["a", "b"]


def test_a_daily_quota_outlives_the_drop_of_its_idle_key(ledger: Ledger, clock, scalar) -> None:
    ledger.configure({"q": NameConfig("q", limit=1, windows=["2/d"])}, now=clock())
    for t in "ab":
        admission = arrive(ledger, t, "q:x", now=clock())
        ledger.release(Token(t, 0), admission.fence, Outcome.COMPLETED, now=clock())
    assert drop_idle_keys_once(ledger.engine, idle=60, now=clock.advance(3600)) == 1
    assert scalar("SELECT count(*) FROM keyed_keys WHERE key = 'q:x'") == 0
    assert prune(ledger.engine, now=clock()) == 0  # the day is not over: the starts still count
    assert arrive(ledger, "c", "q:x", now=clock()).verdict is Verdict.PARKED
    assert 82799 < not_before(scalar, "c", clock()) < 82801


def test_reconcile_forgets_windows_nothing_can_count_any_more(ledger: Ledger, clock, scalar) -> None:
    ledger.configure({"q": NameConfig("q", limit=5, windows=["1/s", "3/m"]),
                      "r": NameConfig("r", limit=5, windows=["1/h"])}, now=clock())
    for t, key in (("a", "q:x"), ("b", "r:x")):
        admission = arrive(ledger, t, key, now=clock())
        ledger.release(Token(t, 0), admission.fence, Outcome.COMPLETED, now=clock())
    assert scalar("SELECT count(*) FROM keyed_window_starts") == 2
    assert prune(ledger.engine, now=clock.advance(59)) == 0
    assert prune(ledger.engine, now=clock.advance(1)) == 1  # q:x's start is a minute old: its longest window
    assert scalar("SELECT string_agg(key, ',') FROM keyed_windows") == "r:x"
    assert scalar("SELECT count(*) FROM keyed_window_starts") == 1  # its starts went with it
    ledger.configure({"r": NameConfig("r", limit=5)}, now=clock())  # r has no windows any more
    report = ledger.reconcile(now=clock())
    assert report.windows_pruned == 1 and scalar("SELECT count(*) FROM keyed_windows") == 0


def test_changing_the_windows_keeps_the_starts_they_can_still_count(ledger: Ledger, clock, scalar) -> None:
    """Raising N re-slots the ring and counts the starts it kept; lowering it counts the latest ones."""
    ledger.configure({"q": NameConfig("q", limit=10, windows=[(2, 60)])}, now=clock())
    for t in "ab":
        assert arrive(ledger, t, "q:x", now=clock()).verdict is Verdict.ADMITTED
    ledger.configure({"q": NameConfig("q", limit=10, windows=[(3, 60)])}, now=clock.advance(1))
    assert arrive(ledger, "c", "q:x", now=clock()).verdict is Verdict.ADMITTED  # the third of a minute's 3
    assert arrive(ledger, "d", "q:x", now=clock()).verdict is Verdict.PARKED
    assert 58.9 < not_before(scalar, "d", clock()) < 59.1  # "a" and "b", at t = 0, still count
    assert scalar("SELECT ring FROM keyed_windows WHERE key = 'q:x'") == 3
    ledger.configure({"q": NameConfig("q", limit=10, windows=[(1, 60)])}, now=clock.advance(1))
    assert arrive(ledger, "e", "q:x", now=clock()).verdict is Verdict.PARKED
    assert 58.9 < not_before(scalar, "e", clock()) < 59.1  # "c", the latest start (t = 1), decides: free at 61
    promoted = [p.task_id for p in ledger.sweep(now=clock.advance(59)).promotions]
    assert promoted == ["d"]  # the head of the line first (d's time came first), e at the next start's turn
    assert scalar("SELECT ring FROM keyed_windows WHERE key = 'q:x'") == 1  # the ring of the new N, re-slotted
    assert scalar("SELECT count(*) FROM keyed_window_starts WHERE key = 'q:x'") == 1


def test_the_bound_holds_over_random_arrivals_releases_and_sweeps(ledger: Ledger, clock, scalar) -> None:
    """An independent count: the times the ledger gave slots (claimed_at) never put more than N starts of the key
    in any window of T, for both windows, whatever the order of arrivals, costs, releases and sweeps."""
    windows = [(3, 2.0), (5, 7.0)]
    ledger.configure({"q": NameConfig("q", limit=4, windows=windows)}, now=clock())
    rng = random.Random(7)
    starts: list[tuple[float, int]] = []
    running: dict[str, int] = {}
    t0 = clock()

    def record(task_id: str, fence: int | None, cost: int) -> None:
        if fence is not None:
            running[task_id] = fence
            starts.append(((clock() - t0).total_seconds(), cost))

    costs: dict[str, int] = {}
    for i in range(160):
        op = rng.random()
        if op < 0.45:
            cost = rng.choice([1, 1, 1, 2])
            costs[f"t{i}"] = cost
            admission = arrive(ledger, f"t{i}", "q:x", cost=cost, now=clock())
            record(f"t{i}", admission.fence, cost)
            for p in admission.promotions:
                record(p.task_id, ledger.bind(p.token, p.nonce, now=clock()), costs[p.task_id])
        elif op < 0.75 and running:
            task_id = rng.choice(sorted(running))
            report = ledger.release(Token(task_id, 0), running.pop(task_id), Outcome.COMPLETED, now=clock())
            for p in report.promotions:
                record(p.task_id, ledger.bind(p.token, p.nonce, now=clock()), costs[p.task_id])
        else:
            for p in ledger.sweep(now=clock.advance(rng.choice([0.1, 0.5, 1.0, 2.5]))).promotions:
                record(p.task_id, ledger.bind(p.token, p.nonce, now=clock()), costs[p.task_id])
    assert sum(c for _, c in starts) >= 20  # the windows let work through, and bound it
    for n, seconds in windows:
        for at, _ in starts:
            inside = sum(c for t, c in starts if at <= t < at + seconds)
            assert inside <= n, f"{inside} starts within {seconds}s from {at}"
    assert check_counters_once(ledger.engine) == []


def test_status_and_explain_show_the_windows(ledger: Ledger, clock, engine: sa.Engine) -> None:
    ledger.configure({"q": NameConfig("q", limit=10, windows=["2/m", "100/d"])}, now=clock())
    for t in "abc":
        arrive(ledger, t, "q:x", now=clock())
    with engine.connect() as conn:
        (name,) = status_names(conn, name="q", now=clock())
        minute, day = usage(conn, "q:x", "q", now=clock())
    assert name.windows == ((2, 60.0), (100, 86400.0))
    assert (minute.used, minute.full, day.used, day.full) == (2, True, 2, False)
    assert minute.frees_at == clock() + timedelta(seconds=60)
    text = ledger.explain("c", now=clock()).text
    assert "2/m" in text and "full" in text, text


def test_status_and_the_metrics_count_the_keys_with_a_full_window(gauge, ledger: Ledger, engine: sa.Engine) -> None:
    """celery_keyed_keys_window_full, per name (never a series per key), from status_names."""
    ledger.configure({"q": NameConfig("q", limit=5, windows=[(2, 3600)]), "p": NameConfig("p", limit=5)})
    for task_id, key in (("a1", "q:a"), ("a2", "q:a"), ("b1", "q:b"), ("p1", "p:1")):
        assert arrive(ledger, task_id, key).admitted
    with engine.connect() as conn:
        assert {n.name: n.window_full_keys for n in status_names(conn)} == {"q": 1, "p": 0}
    assert gauge("celery_keyed_keys_window_full", name="q") == 1
    assert gauge("celery_keyed_keys_window_full", name="p") == 0


def test_concurrent_arrivals_never_take_more_starts_than_a_window_allows(engine: sa.Engine, scalar) -> None:
    """Twelve threads, each its own worker, arrive on one key at once: the window (5 per hour) admits exactly 5."""
    import threading

    Ledger(engine, holder="config:1:aaaa").configure({"q": NameConfig("q", limit=100, windows=[(5, 3600)])})
    verdicts: list[Verdict] = []
    lock = threading.Lock()
    start = threading.Barrier(12)

    def worker(n: int) -> None:
        ledger = Ledger(engine, holder=f"w{n}:1:aaaa", lease=30.0, dispatch=10.0)
        start.wait()
        for i in range(2):
            verdict = arrive(ledger, f"t{n}-{i}", "q:x").verdict
            with lock:
                verdicts.append(verdict)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert verdicts.count(Verdict.ADMITTED) == 5 and verdicts.count(Verdict.PARKED) == 19
    assert positions(scalar, "q:x") == 5 and used(scalar, "q:x") == 5
