"""A change of a name's shard count while its keys hold slots, on real Postgres: the bound of a key (at most K in
flight; an exclusive attempt alone on its key) holds through it in both directions, because a key's shares follow
the layout its slot rows were made for until every holding fits the new count (then the rows move), and a
shared and an exclusive holder never meet on two rows of one key."""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa

from celery_keyed.ledger import EXCLUSIVE_COST, Arrival, Ledger, NameConfig, Outcome, Token, Verdict
from celery_keyed.ledger.reconcile import check_counters_once
from tests.integration.test_readers_writers import finish, reader, run, running, used, writer


def layout(scalar: Callable[..., object], key: str = "doc:1") -> tuple[int, int]:
    """(rows, the shard count they are laid out for) of the key."""
    rows = int(scalar("SELECT count(*) FROM keyed_slots WHERE key = :key", key=key) or 0)
    shards = int(scalar("SELECT COALESCE(max(shards), 0) FROM keyed_slots WHERE key = :key", key=key) or 0)
    return rows, shards


def test_raising_shards_puts_no_reader_beside_a_running_writer(ledger: Ledger, scalar) -> None:
    ledger.configure({"doc": NameConfig("doc", limit=2)})
    w = writer(ledger, "w")
    assert w.verdict is Verdict.ADMITTED and w.shard == 0
    ledger.configure({"doc": NameConfig("doc", limit=2, shards=2)})
    # Was admitted on the new shard 1, beside the writer.
    assert reader(ledger, "r").verdict is Verdict.PARKED
    assert running(scalar) == {"w"}
    assert layout(scalar) == (1, 1)  # the writer's holding does not fit two shards: the rows stay as they are
    (p,) = finish(ledger, "w", w.fence)  # room on the key's one row (its share in two shards: 1)
    assert p.task_id == "r"
    assert layout(scalar) == (1, 1)
    assert ledger.sweep().promotions == []
    assert layout(scalar) == (2, 2)  # the sweep moved the key to two shards: its holding fits them now
    assert reader(ledger, "r2").verdict is Verdict.ADMITTED
    assert check_counters_once(ledger.engine) == []


def test_lowering_shards_puts_no_writer_beside_running_readers(ledger: Ledger, scalar) -> None:
    ledger.configure({"doc": NameConfig("doc", limit=2, shards=2)})
    readers = [reader(ledger, f"r{i}") for i in range(2)]
    assert [r.verdict for r in readers] == [Verdict.ADMITTED] * 2
    assert sorted(r.shard for r in readers) == [0, 1]
    ledger.configure({"doc": NameConfig("doc", limit=2, shards=1)})  # the README's advice for a stuck writer
    # Was admitted on shard 0 (empty) while a reader ran on shard 1.
    assert writer(ledger, "w").verdict is Verdict.PARKED
    on_one = next(r for r, a in zip(("r0", "r1"), readers, strict=True) if a.shard == 1)
    on_zero = "r1" if on_one == "r0" else "r0"
    fences = {f"r{i}": a.fence for i, a in enumerate(readers)}
    assert finish(ledger, on_zero, fences[on_zero]) == []  # a reader still runs (on the shard being dropped)
    assert running(scalar) == {on_one}
    assert finish(ledger, on_one, fences[on_one]) == []  # a release frees its own row only
    (p,) = ledger.sweep().promotions  # the key moves to one shard within a sweep interval; the writer starts
    assert p.task_id == "w" and used(scalar) == EXCLUSIVE_COST
    assert layout(scalar) == (1, 1)
    w_fence = run(ledger, p)
    assert reader(ledger, "r9").verdict is Verdict.PARKED
    assert [x.task_id for x in finish(ledger, "w", w_fence)] == ["r9"]


def test_raising_shards_lets_no_gate_exceed_its_limit(ledger: Ledger, scalar) -> None:
    """K = 4 on one shard, 4 running; two shards now: shares 2 + 2 were computed without the 4 held on shard 0, and
    shard 1 admitted 2 more (6 in flight)."""
    ledger.configure({"doc": NameConfig("doc", limit=4)})
    held = [reader(ledger, f"a{i}") for i in range(4)]
    assert all(a.verdict is Verdict.ADMITTED for a in held)
    ledger.configure({"doc": NameConfig("doc", limit=4, shards=2)})
    assert [reader(ledger, f"b{i}").verdict for i in range(2)] == [Verdict.PARKED] * 2
    assert used(scalar) == 4
    # Two end: shard 0 holds 2 = its share in two shards; the key moves, and the waiters start on shard 1.
    assert finish(ledger, "a0", held[0].fence) == []  # 3 held on shard 0, still over its new share: no room
    assert finish(ledger, "a1", held[1].fence) == []
    promoted = ledger.sweep().promotions
    assert layout(scalar) == (2, 2)
    assert sorted(p.task_id for p in promoted) == ["b0", "b1"]
    assert used(scalar) == 4
    assert check_counters_once(ledger.engine) == []


def test_lowering_shards_lets_no_gate_exceed_its_limit(ledger: Ledger, scalar) -> None:
    """K = 4 on two shards (2 + 2), all held; one shard now: shard 0's share became 4 while shard 1 still held 2."""
    ledger.configure({"doc": NameConfig("doc", limit=4, shards=2)})
    held = [reader(ledger, f"a{i}") for i in range(4)]
    assert all(a.verdict is Verdict.ADMITTED for a in held)
    ledger.configure({"doc": NameConfig("doc", limit=4, shards=1)})
    assert [reader(ledger, f"b{i}").verdict for i in range(2)] == [Verdict.PARKED] * 2
    assert used(scalar) == 4
    on_one = [(i, a) for i, a in enumerate(held) if a.shard == 1]
    for i, a in on_one:
        assert finish(ledger, f"a{i}", a.fence) == []
    promoted = ledger.sweep().promotions
    assert layout(scalar) == (1, 1)
    assert sorted(p.task_id for p in promoted) == ["b0", "b1"]
    assert used(scalar) == 4


def test_the_sweep_moves_a_key_nothing_arrives_at(ledger: Ledger, scalar) -> None:
    ledger.configure({"doc": NameConfig("doc", limit=4)})
    a = reader(ledger, "a")
    ledger.configure({"doc": NameConfig("doc", limit=4, shards=2)})
    assert layout(scalar) == (1, 1)
    ledger.sweep()
    assert layout(scalar) == (2, 2)  # a's one slot fits shard 0's new share of 2
    assert ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED).released
    assert check_counters_once(ledger.engine) == []


def test_a_shard_change_with_costs_keeps_the_sum(ledger: Ledger, scalar) -> None:
    """Weighted attempts: the sum of costs held on the key never exceeds K through a change of shards."""
    ledger.configure({"doc": NameConfig("doc", limit=6)})
    big = ledger.admit(Arrival("big", key="doc:1", cost=5, message={"id": "big"}))
    assert big.verdict is Verdict.ADMITTED
    ledger.configure({"doc": NameConfig("doc", limit=6, shards=3)})
    for i in range(3):
        assert ledger.admit(Arrival(f"s{i}", key="doc:1", cost=1, message={"id": i})).verdict is Verdict.PARKED
    assert used(scalar) == 5
    with ledger.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM keyed_claims WHERE key = 'doc:1'")).scalar_one() == 1
