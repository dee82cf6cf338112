"""Batches on real Postgres (issue 12): ``Ledger.admit_many`` / ``Ledger.release_many`` and the server-side paths
(migration 0005) they and the single calls run on.

Each element of a batch gets its own verdict, in input order; arrivals of one key are decided in input order; one
refused value does not fail the others; N uncontended arrivals / releases cost one round trip; two batches never
deadlock (no retry here: a deadlock fails the test); a batch racing a release never strands a waiter (D2).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import (
    Admission,
    Arrival,
    Ledger,
    NameConfig,
    Outcome,
    ReleaseRequest,
    Token,
    Verdict,
    admit,
    check_counters_once,
    drop_idle_keys_once,
    release,
)
from celery_keyed.ledger.caps import Caps
from tests.integration.test_races import Side, count

HOLDER = "batch:1:aaaa"


class NoRetry(Ledger):
    """A ledger that does not retry a deadlock: Postgres' deadlock detector failing a call fails the test."""

    def transaction(self, work: Callable[[sa.Connection], Any], *, attempts: int = 5) -> Any:
        return super().transaction(work, attempts=1)

    def autocommitted(self, work: Callable[[sa.Connection], Any], *, attempts: int = 5) -> Any:
        return super().autocommitted(work, attempts=1)


@pytest.fixture
def ledger(engine: sa.Engine) -> Ledger:
    ledger = NoRetry(engine, holder=HOLDER, lease=30.0, dispatch=10.0)
    # Which names have a cap is read here, once (a worker reads it every few seconds): the statements these tests
    # count are the arrivals' own.
    ledger.caps = Caps(engine, ttl=float("inf"))
    ledger.caps.refresh()
    return ledger


def wait_for_lock_waiter(engine: sa.Engine, timeout: float = 10.0) -> None:
    """Return once a backend of this test's database waits for a lock (the ledger's calls use connections of
    their own, so the waiter is not the Side's connection)."""
    deadline = time.monotonic() + timeout
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            n = conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND datname = current_database()"
                )
            ).scalar_one()
            if n:
                return
            conn.rollback()
            time.sleep(0.005)
    pytest.fail("nobody blocked on a lock")


@contextmanager
def statements(engine: sa.Engine) -> Iterator[list[str]]:
    """The statements sent to the database inside the block (one round trip each)."""
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        yield sent
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)


def touch(ledger: Ledger, keys: list[str]) -> None:
    """First use of a key creates its rows on the general path; afterwards the batch call admits it."""
    for key in keys:
        a = ledger.admit(Arrival(f"touch-{key}", key=key))
        assert a.fence is not None
        assert ledger.release(Token(f"touch-{key}", 0), a.fence, Outcome.COMPLETED).released


def used(engine: sa.Engine, key: str) -> int:
    return int(count(engine, "SELECT COALESCE(sum(used), 0) FROM keyed_slots WHERE key = :k", k=key))


def parked(engine: sa.Engine, key: str) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text("SELECT task_id FROM keyed_waiting WHERE key = :k ORDER BY priority DESC, arrival"), {"k": key}
            ).scalars()
        )


def test_admit_many_one_round_trip_for_uncontended_keys(engine: sa.Engine, ledger: Ledger) -> None:
    keys = [f"acct:{i}" for i in range(8)]
    touch(ledger, keys)
    with statements(engine) as sent:
        admissions = ledger.admit_many([Arrival(f"t{i}", key=k) for i, k in enumerate(keys)])
    assert [a.verdict for a in admissions] == [Verdict.ADMITTED] * 8
    assert len(sent) == 1, sent
    assert len({a.fence for a in admissions}) == 8
    with statements(engine) as sent:
        reports = ledger.release_many(
            [ReleaseRequest(Token(f"t{i}", 0), a.fence or 0, Outcome.COMPLETED) for i, a in enumerate(admissions)]
        )
    assert len(sent) == 1, sent
    assert [r.released for r in reports] == [True] * 8
    assert [r.finished for r in reports] == [[(f"t{i}", "completed")] for i in range(8)]
    assert all(used(engine, k) == 0 for k in keys)
    assert ledger.books() == {"completed": 16, "arrivals": 16}


def test_admit_many_one_round_trip_for_keys_never_seen(engine: sa.Engine, ledger: Ledger) -> None:
    """A key's first use on a single-shard name is claimed by the batch call too: its slot row and head row are
    created there (as the one-by-one path creates them), one round trip for the batch. A sharded name's new key is
    left to the path that creates every shard's row. Idle, the new keys' rows are dropped as any key's are."""
    ledger.configure({"wide": NameConfig("wide", limit=4, shards=2)})
    keys = [f"fresh:{i}" for i in range(6)]
    with statements(engine) as sent:
        admissions = ledger.admit_many([Arrival(f"f{i}", key=k) for i, k in enumerate(keys)])
    assert [a.verdict for a in admissions] == [Verdict.ADMITTED] * 6
    assert len(sent) == 1, sent
    assert count(engine, "SELECT count(*) FROM keyed_slots WHERE key LIKE 'fresh:%' AND used = 1") == 6
    assert count(engine, "SELECT count(*) FROM keyed_keys WHERE key LIKE 'fresh:%' AND waiting = 0") == 6
    # K = 1 holds on a key created in the same batch: a second arrival of it is not admitted beside the first
    again = ledger.admit_many([Arrival("f-again", key="fresh:0"), Arrival("w0", key="wide:new")])
    assert again[0].verdict == Verdict.PARKED and again[1].verdict == Verdict.ADMITTED
    assert count(engine, "SELECT count(*) FROM keyed_slots WHERE key = 'wide:new'") == 2  # both shards' rows
    reports = ledger.release_many(
        [ReleaseRequest(Token(f"f{i}", 0), a.fence or 0, Outcome.COMPLETED) for i, a in enumerate(admissions)]
        + [ReleaseRequest(Token("w0", 0), again[1].fence or 0, Outcome.COMPLETED)]
    )
    assert all(r.released for r in reports)
    assert [p.task_id for p in reports[0].promotions] == ["f-again"]
    assert check_counters_once(engine) == []
    # idle: every new key's rows go, but fresh:0's (f-again holds its slot, promoted)
    assert drop_idle_keys_once(engine, idle=0.0) == 6
    assert count(engine, "SELECT string_agg(key, ',') FROM keyed_slots WHERE key LIKE 'fresh:%' OR key = 'wide:new'") \
        == "fresh:0"
    assert count(engine, "SELECT string_agg(key, ',') FROM keyed_keys WHERE key LIKE 'fresh:%' OR key = 'wide:new'") \
        == "fresh:0"


def test_a_key_first_used_in_a_batch_holds_its_bound_within_the_batch(engine: sa.Engine, ledger: Ledger) -> None:
    ledger.configure({"pair": NameConfig("pair", limit=2)})
    got = ledger.admit_many([Arrival(f"d{i}", key="fresh:dup") for i in range(3)]
                            + [Arrival(f"p{i}", key="pair:new") for i in range(3)])
    assert [a.verdict for a in got] == [Verdict.ADMITTED, Verdict.PARKED, Verdict.PARKED,
                                        Verdict.ADMITTED, Verdict.ADMITTED, Verdict.PARKED]
    assert used(engine, "fresh:dup") == 1 and used(engine, "pair:new") == 2
    assert parked(engine, "fresh:dup") == ["d1", "d2"] and parked(engine, "pair:new") == ["p2"]
    assert check_counters_once(engine) == []


def test_batch_where_some_rows_are_admitted_and_others_park(engine: sa.Engine, ledger: Ledger) -> None:
    ledger.configure({"gate": NameConfig("gate", limit=2)})
    touch(ledger, ["gate:x", "acct:1", "acct:2"])
    batch = [
        Arrival("g1", key="gate:x"),
        Arrival("a1", key="acct:1"),
        Arrival("g2", key="gate:x"),
        Arrival("a2", key="acct:1"),
        Arrival("g3", key="gate:x"),
        Arrival("b1", key="acct:2"),
        Arrival("new1", key="acct:never-seen"),  # first use: decided on its own
    ]
    got = ledger.admit_many(batch)
    assert [a.verdict for a in got] == [
        Verdict.ADMITTED,
        Verdict.ADMITTED,
        Verdict.ADMITTED,
        Verdict.PARKED,
        Verdict.PARKED,
        Verdict.ADMITTED,
        Verdict.ADMITTED,
    ]
    assert used(engine, "gate:x") == 2 and used(engine, "acct:1") == 1 and used(engine, "acct:2") == 1
    assert parked(engine, "gate:x") == ["g3"] and parked(engine, "acct:1") == ["a2"]
    assert count(engine, "SELECT waiting FROM keyed_keys WHERE key = 'gate:x'") == 1
    # The parked ones start when room frees, through the batched release.
    reports = ledger.release_many(
        [
            ReleaseRequest(Token("g1", 0), got[0].fence or 0, Outcome.COMPLETED),
            ReleaseRequest(Token("a1", 0), got[1].fence or 0, Outcome.COMPLETED),
        ]
    )
    assert [[p.task_id for p in r.promotions] for r in reports] == [["g3"], ["a2"]]
    assert parked(engine, "gate:x") == [] and parked(engine, "acct:1") == []
    assert check_counters_once(engine) == []  # no drift


def test_fifo_within_a_key_in_the_batch_call(engine: sa.Engine, ledger: Ledger) -> None:
    """A retry (a known task: the batch call leaves it to the general path) comes first; the new arrival of the
    same key behind it must not take the free slot ahead of it."""
    touch(ledger, ["acct:9"])
    first = ledger.admit(Arrival("r", key="acct:9"))
    assert ledger.release(Token("r", 0), first.fence or 0, Outcome.RETRY).released
    got = ledger.admit_many([Arrival("r", attempt=1, key="acct:9"), Arrival("n", key="acct:9")])
    assert [a.verdict for a in got] == [Verdict.ADMITTED, Verdict.PARKED]
    assert parked(engine, "acct:9") == ["n"]


def test_fifo_within_a_key_across_batched_and_per_arrival_rows(engine: sa.Engine, ledger: Ledger, clock) -> None:
    """An arrival the batch call cannot take (a not-before time, here already passed) is decided before the later
    arrival of its key that the call could have admitted at once."""
    touch(ledger, ["acct:7"])
    got = ledger.admit_many(
        [Arrival("early", key="acct:7", not_before=clock() - timedelta(seconds=1)), Arrival("late", key="acct:7")],
        now=clock(),
    )
    assert [a.verdict for a in got] == [Verdict.ADMITTED, Verdict.PARKED]


def test_fifo_within_a_key_parks_in_input_order(engine: sa.Engine, ledger: Ledger) -> None:
    touch(ledger, ["acct:5"])
    holder = ledger.admit(Arrival("h", key="acct:5"))
    names = [f"w{i}" for i in range(6)]
    got = ledger.admit_many([Arrival(n, key="acct:5") for n in names])
    assert [a.verdict for a in got] == [Verdict.PARKED] * 6
    assert parked(engine, "acct:5") == names
    fence, task = holder.fence or 0, "h"
    started = []
    for _ in names:
        report = ledger.release(Token(task, 0), fence, Outcome.COMPLETED)
        assert len(report.promotions) == 1
        promotion = report.promotions[0]
        assert promotion.nonce is not None
        fence = ledger.bind(promotion.token, promotion.nonce) or 0
        task = promotion.task_id
        started.append(task)
    assert started == names


@pytest.mark.parametrize(
    "poison",
    [
        Arrival("bad", key="acct:\x00bad"),  # the database refuses a NUL character
        Arrival("bad", attempt=2**31, key="acct:2"),  # out of the integer range
    ],
    ids=["nul-in-key", "attempt-out-of-range"],
)
def test_a_poison_row_does_not_lose_the_others(engine: sa.Engine, ledger: Ledger, poison: Arrival) -> None:
    touch(ledger, ["acct:1", "acct:2", "acct:3"])
    got = ledger.admit_many([Arrival("ok1", key="acct:1"), poison, Arrival("ok3", key="acct:3")])
    assert [a.verdict for a in got] == [Verdict.ADMITTED, Verdict.REJECTED, Verdict.ADMITTED]
    assert got[1].detail.startswith("refused by the ledger's database"), got[1].detail
    assert used(engine, "acct:1") == 1 and used(engine, "acct:3") == 1
    # Booked as rejected (its task id could be stored), so the books balance.
    assert count(engine, "SELECT outcome FROM keyed_tasks WHERE task_id = 'bad'") == "rejected"


def test_an_arrival_recorded_before_its_refusal_is_booked_rejected(engine: sa.Engine, ledger: Ledger) -> None:
    """A message the ledger cannot store (an ``Infinity`` in a foreign producer's header: not JSON for Postgres) on a
    key with no room: the fast claim records the arrival and commits alone, then parking it is refused. The task
    still gets its one outcome, rejected (it had no books row before: a KeyedRejected result and no outcome), while
    a copy of a task that runs keeps its books."""
    touch(ledger, ["acct:1"])
    running = ledger.admit(Arrival("run", key="acct:1"))
    assert running.verdict is Verdict.ADMITTED
    poison = {"headers": {"keyed_supersede": math.inf}}
    got = ledger.admit_many([Arrival("bad", key="acct:1", message=poison)])
    assert [a.verdict for a in got] == [Verdict.REJECTED]
    assert got[0].detail.startswith("refused by the ledger's database"), got[0].detail
    assert count(engine, "SELECT outcome FROM keyed_tasks WHERE task_id = 'bad'") == "rejected"
    copy = ledger.admit_many([Arrival("run", key="acct:1", message=poison)])  # a copy of the running task
    assert copy[0].verdict is not Verdict.ADMITTED
    assert count(engine, "SELECT outcome FROM keyed_tasks WHERE task_id = 'run'") is None  # still running
    assert count(engine, "SELECT count(*) FROM keyed_claims WHERE task_id = 'run'") == 1


def test_a_poison_task_id_is_rejected_and_not_booked(engine: sa.Engine, ledger: Ledger) -> None:
    touch(ledger, ["acct:1"])
    got = ledger.admit_many([Arrival("bad\x00", key="acct:1"), Arrival("ok", key="acct:1")])
    assert [a.verdict for a in got] == [Verdict.REJECTED, Verdict.ADMITTED]
    assert got[0].detail.endswith("(not booked)")


def test_release_many_mixed_requests_each_get_their_own_report(engine: sa.Engine, ledger: Ledger) -> None:
    touch(ledger, ["acct:1", "acct:2", "acct:3"])
    a = ledger.admit_many([Arrival("a", key="acct:1"), Arrival("b", key="acct:2"), Arrival("c", key="acct:3")])
    g = ledger.admit(Arrival("g", key="acct:4", group_key="order:1"))
    reports = ledger.release_many(
        [
            ReleaseRequest(Token("a", 0), a[0].fence or 0, Outcome.COMPLETED),
            ReleaseRequest(Token("b", 0), (a[1].fence or 0) + 1000, Outcome.COMPLETED),  # stale fence
            ReleaseRequest(Token("g", 0), g.fence or 0, Outcome.FAILED),  # a group: the general path
            ReleaseRequest(Token("c", 0), a[2].fence or 0, Outcome.WORKER_LOST),  # lost: the general path
            ReleaseRequest(Token("a", 0), a[0].fence or 0, Outcome.COMPLETED),  # the same twice: released once
        ]
    )
    assert [r.released for r in reports] == [True, False, True, True, False]
    assert reports[0].finished == [("a", "completed")]
    assert reports[2].finished == [("g", "dead_lettered")]
    assert used(engine, "acct:1") == 0 and used(engine, "acct:2") == 1 and used(engine, "acct:3") == 0
    assert count(engine, "SELECT count(*) FROM keyed_claims") == 1  # b's


def test_release_many_promotes_locally_when_asked(engine: sa.Engine, ledger: Ledger) -> None:
    touch(ledger, ["acct:1", "acct:2"])
    held = ledger.admit_many([Arrival("h1", key="acct:1"), Arrival("h2", key="acct:2")])
    for i, key in enumerate(["acct:1", "acct:1", "acct:2"]):
        message = {"task": "proj.sync"}
        assert ledger.admit(Arrival(f"w{i}", key=key, queue="q", message=message)).verdict is Verdict.PARKED
    reports = ledger.release_many(
        [
            ReleaseRequest(
                Token(f"h{i + 1}", 0),
                held[i].fence or 0,
                Outcome.COMPLETED,
                local_queues=frozenset({"q"}),
                local_tasks=frozenset({"proj.sync"}),
                contended=contended,
            )
            for i, contended in enumerate([True, False])
        ]
    )
    promotions = [p for r in reports for p in r.promotions]
    assert sorted(p.task_id for p in promotions) == ["w0", "w2"]
    assert all(p.nonce is None for p in promotions)  # both run here (D4): running claims of this holder
    assert count(engine, "SELECT count(*) FROM keyed_claims WHERE state = 'running' AND holder = :h", h=HOLDER) == 2
    assert parked(engine, "acct:1") == ["w1"]


def test_batch_racing_a_release_is_admitted_not_parked(engine: sa.Engine, ledger: Ledger) -> None:
    """A release holds the key's slot row; the batch call waits for it and takes the freed slot (D2: never parked
    next to a free slot)."""
    touch(ledger, ["acct:1", "acct:2"])
    holder = ledger.admit(Arrival("h", key="acct:1"))
    with engine.connect() as conn, conn.begin():
        assert release.release(conn, Token("h", 0), holder.fence or 0, Outcome.COMPLETED).released
        batch = Side(engine, lambda c: ledger.admit_many([Arrival("x", key="acct:2"), Arrival("y", key="acct:1")]))
        batch.start()
        wait_for_lock_waiter(engine)
    got = batch.finish()
    assert [a.verdict for a in got] == [Verdict.ADMITTED, Verdict.ADMITTED]
    assert used(engine, "acct:1") == 1 and parked(engine, "acct:1") == []


def test_release_many_racing_a_park_promotes_the_parked(engine: sa.Engine, ledger: Ledger) -> None:
    """A park holds the key's slot row; the batched release waits for it and, reading the waiters in a later
    statement (D2), promotes the parked attempt instead of leaving it stranded next to a free slot."""
    touch(ledger, ["acct:1", "acct:2"])
    held = ledger.admit_many([Arrival("h1", key="acct:1"), Arrival("h2", key="acct:2")])
    with engine.connect() as conn, conn.begin():
        parked_now = admit.admit(conn, Arrival("p", key="acct:1"), holder=HOLDER, lease=30.0)
        assert parked_now.verdict is Verdict.PARKED
        requests = [ReleaseRequest(Token(f"h{i + 1}", 0), held[i].fence or 0, Outcome.COMPLETED) for i in range(2)]
        releaser = Side(engine, lambda c: ledger.release_many(requests))
        releaser.start()
        wait_for_lock_waiter(engine)
    reports = releaser.finish()
    assert [[p.task_id for p in r.promotions] for r in reports] == [["p"], []]
    assert count(engine, "SELECT state FROM keyed_claims WHERE task_id = 'p'") == "promoted"
    assert used(engine, "acct:1") == 1 and parked(engine, "acct:1") == []


def test_two_batches_with_overlapping_keys_in_opposite_orders_never_deadlock(
    engine: sa.Engine, ledger: Ledger
) -> None:
    ledger.configure({"gate": NameConfig("gate", limit=1000), "wide": NameConfig("wide", limit=1000, shards=4)})
    keys = [f"gate:{i}" for i in range(12)] + [f"wide:{i}" for i in range(4)]
    touch(ledger, keys)
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(side: int, order: list[str]) -> None:
        try:
            for round_ in range(40):
                start.wait(timeout=30)
                arrivals = [Arrival(f"s{side}-{round_}-{i}", key=k) for i, k in enumerate(order)]
                got = ledger.admit_many(arrivals)
                assert all(a.verdict is Verdict.ADMITTED for a in got), got
                start.wait(timeout=30)
                done = zip(arrivals, got, strict=True)
                ledger.release_many([ReleaseRequest(a.token, g.fence or 0, Outcome.COMPLETED) for a, g in done])
        except BaseException as exc:  # reported below
            errors.append(exc)
            start.abort()

    threads = [
        threading.Thread(target=run, args=(0, keys)),
        threading.Thread(target=run, args=(1, list(reversed(keys)))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    assert all(used(engine, k) == 0 for k in keys)
    assert check_counters_once(engine) == []  # no drift


# -- the arrivals a batch leaves undecided, and park at receipt, in one more round trip (migration 0019) -----------


def test_the_arrivals_the_batch_call_does_not_admit_are_parked_in_one_more_round_trip(
    engine: sa.Engine, ledger: Ledger
) -> None:
    """A burst on held keys: the batched claim admits none; the rest are parked by one call (keyed_admit_plain_many,
    a transaction each), each key's line in input order."""
    touch(ledger, ["acct:1", "acct:2"])
    holders = ledger.admit_many([Arrival("h1", key="acct:1"), Arrival("h2", key="acct:2")])
    names = ["a1", "b1", "a2", "b2", "a3", "b3"]
    with statements(engine) as sent:
        got = ledger.admit_many([Arrival(n, key=f"acct:{1 if n[0] == 'a' else 2}") for n in names])
    assert [a.verdict for a in got] == [Verdict.PARKED] * 6
    assert len(sent) == 2, sent  # keyed_claim_many, then keyed_admit_plain_many
    assert parked(engine, "acct:1") == ["a1", "a2", "a3"] and parked(engine, "acct:2") == ["b1", "b2", "b3"]
    assert count(engine, "SELECT waiting FROM keyed_keys WHERE key = 'acct:1'") == 3
    reports = ledger.release_many(
        [ReleaseRequest(Token(f"h{i + 1}", 0), holders[i].fence or 0, Outcome.COMPLETED) for i in range(2)]
    )
    assert [[p.task_id for p in r.promotions] for r in reports] == [["a1"], ["b1"]]
    assert check_counters_once(engine) == []


def test_an_arrival_the_batch_leaves_to_the_general_path_keeps_its_place(engine: sa.Engine, ledger: Ledger) -> None:
    """A retry of a known task on a held key: the batched park leaves it to the general path (a known token, D8) and
    the new arrival of the same key behind it is not decided ahead of it (D10)."""
    touch(ledger, ["acct:4"])
    first = ledger.admit(Arrival("r", key="acct:4"))
    assert ledger.release(Token("r", 0), first.fence or 0, Outcome.RETRY).released
    holder = ledger.admit(Arrival("h", key="acct:4"))
    got = ledger.admit_many([Arrival("r", attempt=1, key="acct:4"), Arrival("n", key="acct:4")])
    assert [a.verdict for a in got] == [Verdict.PARKED, Verdict.PARKED]
    assert parked(engine, "acct:4") == ["r", "n"]
    report = ledger.release(Token("h", 0), holder.fence or 0, Outcome.COMPLETED)
    assert [p.task_id for p in report.promotions] == ["r"]


def test_the_batch_numbers_its_parked_rows_in_input_order_across_keys(
    engine: sa.Engine, ledger: Ledger, clock
) -> None:
    """The batched park stops at the first arrival it leaves to the general path — here one whose key has room next
    to a waiter that became due (the general path promotes the waiter, then parks it) — so the arrivals after it, of
    any key, are parked after it: numbered in input order, as one-by-one calls number them."""
    touch(ledger, ["acct:5", "acct:6"])
    ledger.admit(Arrival("h5", key="acct:5"), now=clock())
    due = ledger.admit(Arrival("due", key="acct:6", not_before=clock() + timedelta(seconds=1)), now=clock())
    assert due.verdict is Verdict.PARKED
    clock.advance(2)  # due now, not swept yet: acct:6 has room next to a promotable waiter
    got = ledger.admit_many([Arrival("x", key="acct:6"), Arrival("b", key="acct:5"), Arrival("c", key="acct:5")],
                            now=clock())
    assert [a.verdict for a in got] == [Verdict.PARKED] * 3
    with engine.connect() as conn:
        order = list(
            conn.execute(sa.text("SELECT task_id FROM keyed_waiting WHERE task_id <> 'due' ORDER BY arrival")).scalars()
        )
    assert order == ["x", "b", "c"]


def test_park_many_at_receipt_parks_where_there_is_a_line_and_leaves_the_rest(
    engine: sa.Engine, ledger: Ledger
) -> None:
    touch(ledger, ["acct:1", "acct:2", "acct:3"])
    ledger.admit(Arrival("h1", key="acct:1"))
    ledger.admit(Arrival("h3", key="acct:3"))
    batch = [
        Arrival("a1", key="acct:1"),
        Arrival("free1", key="acct:2"),  # room and no line: left to its admission at pool-ready (D3)
        Arrival("a2", key="acct:1"),
        Arrival("free2", key="acct:2"),  # behind free1 of its key: left alone too, never parked ahead of it (D10)
        Arrival("c1", key="acct:3"),
    ]
    with statements(engine) as sent:
        got = ledger.park_many_at_receipt(batch)
    assert len(sent) == 1, sent
    assert [a.verdict if isinstance(a, Admission) else a for a in got] == [
        Verdict.PARKED, None, Verdict.PARKED, None, Verdict.PARKED
    ]
    assert parked(engine, "acct:1") == ["a1", "a2"] and parked(engine, "acct:2") == [] and parked(engine, "acct:3") == [
        "c1"
    ]
    assert used(engine, "acct:2") == 0  # never takes a slot
    assert count(engine, "SELECT count(*) FROM keyed_tasks WHERE task_id IN ('free1', 'free2')") == 0


def test_park_many_at_receipt_one_message_the_database_refuses(engine: sa.Engine, ledger: Ledger) -> None:
    """An Infinity in a foreign producer's header is not JSON for Postgres: that arrival's statement is rolled back
    and its own call raises, as on its own; the arrivals before and after it are parked, and the later arrival of
    its key is left alone (never parked ahead of it)."""
    touch(ledger, ["acct:1", "acct:2"])
    ledger.admit(Arrival("h1", key="acct:1"))
    ledger.admit(Arrival("h2", key="acct:2"))
    poison = {"headers": {"keyed_supersede": math.inf}}
    got = ledger.park_many_at_receipt(
        [
            Arrival("a1", key="acct:1"),
            Arrival("bad", key="acct:2", message=poison),
            Arrival("a2", key="acct:1"),
            Arrival("b2", key="acct:2"),
        ]
    )
    assert isinstance(got[0], Admission) and got[0].verdict is Verdict.PARKED
    assert isinstance(got[1], sa.exc.DBAPIError), got[1]
    assert isinstance(got[2], Admission) and got[2].verdict is Verdict.PARKED
    assert got[3] is None
    assert parked(engine, "acct:1") == ["a1", "a2"] and parked(engine, "acct:2") == []


def test_park_many_at_receipt_racing_a_release_never_strands_a_waiter(engine: sa.Engine, ledger: Ledger) -> None:
    """A release holds the key's slot row while the batch's park waits for it: the park sees the freed slot and
    leaves the arrival to its admission (no line, room: D3), or it parked first and the release promotes it —
    never parked next to a free slot (D2)."""
    touch(ledger, ["acct:1", "acct:2"])
    holder = ledger.admit(Arrival("h", key="acct:1"))
    ledger.admit(Arrival("h2", key="acct:2"))
    with engine.connect() as conn, conn.begin():
        assert release.release(conn, Token("h", 0), holder.fence or 0, Outcome.COMPLETED).released
        batch = Side(
            engine, lambda c: ledger.park_many_at_receipt([Arrival("x", key="acct:2"), Arrival("y", key="acct:1")])
        )
        batch.start()
        wait_for_lock_waiter(engine)
    got = batch.finish()
    assert isinstance(got[0], Admission) and got[0].verdict is Verdict.PARKED
    assert got[1] is None  # the slot it waited for was free once it got it: not parked
    assert used(engine, "acct:1") == 0 and parked(engine, "acct:1") == []


def test_park_many_at_receipt_and_releases_in_a_loop_strand_nobody(engine: sa.Engine, ledger: Ledger) -> None:
    """Batches of parks at receipt race the releases of the key's holders, many times over: whatever interleaving
    Postgres picks, every parked attempt is promoted by a release (nobody waits next to a free slot) and the counter
    never drifts."""
    touch(ledger, ["acct:r"])
    first = ledger.admit(Arrival("r-0", key="acct:r"))
    state = {"token": Token("r-0", 0), "fence": first.fence or 0}
    done = threading.Event()
    errors: list[BaseException] = []
    left: list[str] = []

    def parks() -> None:
        try:
            for round_ in range(30):
                answers = ledger.park_many_at_receipt([Arrival(f"p{round_}-{i}", key="acct:r") for i in range(4)])
                left.extend(f"p{round_}-{i}" for i, a in enumerate(answers) if a is None)
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    def releases() -> None:
        try:
            while not done.is_set() or parked(engine, "acct:r"):
                report = ledger.release(state["token"], state["fence"], Outcome.COMPLETED)
                if report.promotions:
                    p = report.promotions[0]
                    state["token"], state["fence"] = p.token, ledger.bind(p.token, p.nonce) or 0
                else:  # nobody waited: take the key again with an arrival of our own
                    again = ledger.admit(Arrival(f"r-{time.monotonic_ns()}", key="acct:r"))
                    if again.verdict is not Verdict.ADMITTED:
                        continue
                    state["token"], state["fence"] = Token(again.task_id, 0), again.fence or 0
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=parks), threading.Thread(target=releases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    assert parked(engine, "acct:r") == []
    assert ledger.release(state["token"], state["fence"], Outcome.COMPLETED).released
    assert used(engine, "acct:r") == 0
    assert check_counters_once(engine) == []


# -- one round trip per transaction on the hot path (issue 12 item 2) ------------------------------------------------


def test_park_of_a_plain_arrival_is_the_fast_claim_and_one_call(engine: sa.Engine, ledger: Ledger) -> None:
    touch(ledger, ["acct:1"])
    ledger.admit(Arrival("h", key="acct:1"))
    with statements(engine) as sent:
        assert ledger.admit(Arrival("p", key="acct:1", queue="q", message={"task": "t"})).verdict is Verdict.PARKED
    assert len(sent) == 2, sent  # CLAIM_NEW (no room), then keyed_admit_plain
    assert "keyed_admit_plain" in sent[1]
    assert parked(engine, "acct:1") == ["p"]
    assert count(engine, "SELECT waiting FROM keyed_keys WHERE key = 'acct:1'") == 1
    assert count(engine, "SELECT message ->> 'task' FROM keyed_waiting WHERE task_id = 'p'") == "t"


def test_first_use_of_a_key_is_admitted_by_one_call(engine: sa.Engine, ledger: Ledger) -> None:
    with statements(engine) as sent:
        assert ledger.admit(Arrival("a", key="acct:new")).verdict is Verdict.ADMITTED
    # One call: a key this ledger has not admitted by the fast claim before goes straight to keyed_admit_plain, which
    # creates its slot rows and takes one (the fast claim would miss first: no slot rows yet).
    assert [s.split("(")[0].split()[-1] for s in sent] == ["keyed_admit_plain"], sent
    with statements(engine) as sent:  # the key's next arrival tries the fast claim first (it admitted the last)
        assert ledger.admit(Arrival("b", key="acct:new")).verdict is Verdict.PARKED
    assert len(sent) == 2, sent  # the fast claim found no room; keyed_admit_plain parked it
    with statements(engine) as sent:  # no room last time: straight to keyed_admit_plain
        assert ledger.admit(Arrival("c", key="acct:new")).verdict is Verdict.PARKED
    assert [s.split("(")[0].split()[-1] for s in sent] == ["keyed_admit_plain"], sent
    assert used(engine, "acct:new") == 1
    assert count(engine, "SELECT count(*) FROM keyed_keys WHERE key = 'acct:new'") == 1  # seen (prefix capture)


def test_a_full_waiting_room_rejects_in_one_call(engine: sa.Engine, ledger: Ledger) -> None:
    ledger.configure({"acct": NameConfig("acct", limit=1, max_waiting=1)})
    touch(ledger, ["acct:1"])
    ledger.admit(Arrival("h", key="acct:1"))
    assert ledger.admit(Arrival("p", key="acct:1")).verdict is Verdict.PARKED
    with statements(engine) as sent:
        got = ledger.admit(Arrival("r", key="acct:1"))
    assert got.verdict is Verdict.REJECTED and got.detail == "waiting room of acct:1 is full"
    assert len(sent) == 1, sent  # the key had no room last time: keyed_admit_plain alone decides
    assert count(engine, "SELECT outcome FROM keyed_tasks WHERE task_id = 'r'") == "rejected"
    assert count(engine, "SELECT waiting FROM keyed_keys WHERE key = 'acct:1'") == 1


@pytest.mark.parametrize("contended", [False, True])
def test_release_and_promote_of_one_plain_key(engine: sa.Engine, ledger: Ledger, contended: bool) -> None:
    touch(ledger, ["acct:1"])
    holder = ledger.admit(Arrival("h", key="acct:1"))
    ledger.admit(Arrival("p", key="acct:1", queue="q", message={"task": "proj.sync"}))
    with statements(engine) as sent:
        report = ledger.release(
            Token("h", 0), holder.fence or 0, Outcome.COMPLETED, contended=contended, local_queues=["q"],
            local_tasks=["proj.sync"],
        )
    assert [p.task_id for p in report.promotions] == ["p"] and report.promotions[0].nonce is None  # local (D4)
    # One self-committing call (migration 0007), contended or not (it was keyed_release_many + keyed_promote_plain).
    assert [s.split("(")[0].split()[-1] for s in sent] == ["keyed_release_and_promote"], sent
    assert count(engine, "SELECT holder FROM keyed_claims WHERE task_id = 'p' AND state = 'running'") == HOLDER
    assert used(engine, "acct:1") == 1 and parked(engine, "acct:1") == []
    assert count(engine, "SELECT waiting FROM keyed_keys WHERE key = 'acct:1'") == 0


def test_release_without_waiters_is_one_call(engine: sa.Engine, ledger: Ledger) -> None:
    touch(ledger, ["acct:1"])
    holder = ledger.admit(Arrival("h", key="acct:1"))
    with statements(engine) as sent:
        report = ledger.release(Token("h", 0), holder.fence or 0, Outcome.COMPLETED)
    assert report.released and report.finished == [("h", "completed")]
    assert len(sent) == 1, sent


def test_a_line_whose_head_is_not_plain_is_promoted_by_the_general_path(engine: sa.Engine, ledger: Ledger) -> None:
    """keyed_promote_plain stops at a head with a group; the rest of the line is promoted in the same
    transaction by promote.promote_waiters (the grouped head first: FIFO)."""
    touch(ledger, ["acct:1"])
    holder = ledger.admit(Arrival("h", key="acct:1"))
    assert ledger.admit(Arrival("g", key="acct:1", group_key="order:1")).verdict is Verdict.PARKED
    assert ledger.admit(Arrival("p", key="acct:1")).verdict is Verdict.PARKED
    report = ledger.release(Token("h", 0), holder.fence or 0, Outcome.COMPLETED, contended=True)
    assert [(p.task_id, p.group_key) for p in report.promotions] == [("g", "order:1")]
    assert count(engine, "SELECT group_key FROM keyed_claims WHERE task_id = 'g'") == "order:1"  # the group's slot
    assert parked(engine, "acct:1") == ["p"]


def test_bind_of_a_promotion_is_one_statement(
    engine: sa.Engine, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    touch(ledger, ["acct:1"])
    holder = ledger.admit(Arrival("h", key="acct:1"))
    ledger.admit(Arrival("p", key="acct:1"))
    promotion = ledger.release(Token("h", 0), holder.fence or 0, Outcome.COMPLETED).promotions[0]
    assert promotion.nonce is not None

    def no_transaction(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("bind opened a transaction (BEGIN / COMMIT round trips)")

    monkeypatch.setattr(ledger, "transaction", no_transaction)
    with statements(engine) as sent:
        assert ledger.bind(promotion.token, promotion.nonce) == promotion.fence
    assert len(sent) == 1, sent
    assert count(engine, "SELECT state FROM keyed_claims WHERE task_id = 'p'") == "running"
