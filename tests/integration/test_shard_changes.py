"""Readers and writers across every slot row of a key (DESIGN D18), on real Postgres: an exclusive claim needs every
row of its key empty, a shared claim needs no exclusive holder on any row, whatever the name's shard count, limit or
override became meanwhile. The guard looks at the rows, not at the configuration, so a change of shards can never
put a writer beside a reader. Limits stay below the exclusive cost, and no cost an arrival asks for can be it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import (
    EXCLUSIVE_COST,
    SLOT_LIMIT_MAX,
    Admission,
    Arrival,
    InvalidConfig,
    Ledger,
    NameConfig,
    Outcome,
    Token,
    Verdict,
    admit,
)
from celery_keyed.ledger.reconcile import check_counters_once
from tests.integration.test_races import Side, wait_until_blocked

HOLDER = "shards-test:1:beef"


def _reader_paths(engine: sa.Engine, ledger: Ledger) -> dict[str, Callable[[Arrival], Admission]]:
    """Every way a shared arrival of one key can be admitted: the general path (its one-statement fast path first),
    the batch (keyed_claim_many), and the one-call plain path (keyed_admit_or_park_plain)."""

    def plain(arrival: Arrival) -> Admission:
        with engine.begin() as conn:
            got, _ = admit.admit_plain(conn, arrival, holder=HOLDER, lease=30.0)
        return got if got is not None else ledger.admit(arrival)

    return {
        "admit": ledger.admit,
        "admit_many": lambda arrival: ledger.admit_many([arrival])[0],
        "admit_plain": plain,
    }


def _claims(engine: sa.Engine, key: str = "doc:1") -> dict[str, tuple[int, int]]:
    with engine.connect() as conn:
        return {
            r.task_id: (r.shard, r.cost)
            for r in conn.execute(sa.text("SELECT task_id, shard, cost FROM keyed_claims WHERE key = :k"), {"k": key})
        }


def _alone_or_shared(engine: sa.Engine, key: str = "doc:1") -> None:
    """The bound of readers and writers across every row of the key: an exclusive holder is the only claim."""
    held = _claims(engine, key)
    writers = [t for t, (_, cost) in held.items() if cost == EXCLUSIVE_COST]
    assert not writers or len(held) == 1, f"a writer beside others on {key}: {held}"


@pytest.mark.parametrize("path", ["admit", "admit_many", "admit_plain"])
def test_more_shards_do_not_let_a_reader_beside_a_running_writer(
    engine: sa.Engine, ledger: Ledger, path: str
) -> None:
    """A writer runs on the key's only row; the name goes to two shards; the new row 1 has a share, but a reader
    must still wait for the writer (it ran beside it: the reader's guard looked at its own row only)."""
    ledger.configure({"doc": NameConfig("doc", limit=2)})
    w = ledger.admit(Arrival("w", key="doc:1", cost=EXCLUSIVE_COST, message={}))
    assert w.verdict is Verdict.ADMITTED and w.fence is not None
    ledger.configure({"doc": NameConfig("doc", limit=2, shards=2)})
    admit_reader = _reader_paths(engine, ledger)[path]
    for i in range(4):  # the fast paths pick a row at random: every try must park
        got = admit_reader(Arrival(f"r{i}", key="doc:1", message={}))
        assert got.verdict is Verdict.PARKED, (i, got)
        _alone_or_shared(engine)
    report = ledger.release(Token("w", 0), w.fence, Outcome.COMPLETED)
    # K = 2, one per shard: the release fills the row it gave back; the other row's room, which the writer held
    # shut, is filled by the sweep (D2: within one sweep interval).
    assert [p.task_id for p in report.promotions] == ["r0"]
    assert [p.task_id for p in ledger.sweep().promotions] == ["r1"]
    _alone_or_shared(engine)
    assert check_counters_once(engine) == []


def test_fewer_shards_do_not_let_a_writer_beside_draining_readers(engine: sa.Engine, ledger: Ledger) -> None:
    """Readers hold both rows of a two-shard name; the name goes back to one shard (the way to let a writer run on
    it); the reader on row 0 ends. Row 0 is empty, but row 1 still has a reader: the writer waits for it, and
    starts once every row is empty (a drained row has no share, so its release makes no room: the sweep starts it)."""
    ledger.configure({"doc": NameConfig("doc", limit=2, shards=2)})
    first = [ledger.admit(Arrival(f"r{i}", key="doc:1", message={})) for i in range(2)]
    assert [a.verdict for a in first] == [Verdict.ADMITTED, Verdict.ADMITTED]
    by_shard = {a.shard: (f"r{i}", a.fence) for i, a in enumerate(first)}
    assert set(by_shard) == {0, 1}
    ledger.configure({"doc": NameConfig("doc", limit=2)})
    zero_id, zero_fence = by_shard[0]
    ledger.release(Token(zero_id, 0), zero_fence, Outcome.COMPLETED)

    w = ledger.admit(Arrival("w", key="doc:1", cost=EXCLUSIVE_COST, message={}))
    assert w.verdict is Verdict.PARKED, w  # was ADMITTED on row 0 beside the reader on row 1
    _alone_or_shared(engine)
    one_id, one_fence = by_shard[1]
    ledger.release(Token(one_id, 0), one_fence, Outcome.COMPLETED)  # row 1 drained: its share is 0, no room on it
    assert [p.task_id for p in ledger.sweep().promotions] == ["w"]  # every row empty: the writer starts (D2)
    assert _claims(engine) == {"w": (0, EXCLUSIVE_COST)}
    assert check_counters_once(engine) == []


def test_a_sweep_promotes_a_writer_only_when_every_row_is_empty(engine: sa.Engine, ledger: Ledger) -> None:
    """Same drain, the writer parked first: a raise of the limit (a promotion of the whole key) or a sweep finds
    row 0 empty but must leave the writer waiting while row 1 holds a reader."""
    ledger.configure({"doc": NameConfig("doc", limit=1)})
    w0 = ledger.admit(Arrival("w0", key="doc:1", cost=EXCLUSIVE_COST, message={}))
    assert w0.verdict is Verdict.ADMITTED and w0.fence is not None
    assert ledger.admit(Arrival("w1", key="doc:1", cost=EXCLUSIVE_COST, message={})).verdict is Verdict.PARKED
    ledger.release(Token("w0", 0), w0.fence, Outcome.COMPLETED)  # w1 promoted on row 0
    [bound] = [c for c in _claims(engine)]
    assert bound == "w1"
    # Two shards now; w1 holds row 0; a reader must wait; the limit goes up: still nobody beside w1.
    ledger.configure({"doc": NameConfig("doc", limit=4, shards=2)})
    assert ledger.admit(Arrival("r", key="doc:1", message={})).verdict is Verdict.PARKED
    assert ledger.set_override("doc", 6, reason="more") == []
    assert ledger.sweep().promotions == []
    _alone_or_shared(engine)


@pytest.mark.parametrize("where", ["configure", "set_override", "set_key_limit"])
def test_limits_stay_below_the_exclusive_cost(ledger: Ledger, where: str) -> None:
    """A limit of EXCLUSIVE_COST or more would let readers join a writer: refused with a clear error."""
    calls: dict[str, Callable[[int], object]] = {
        "configure": lambda n: ledger.configure({"doc": NameConfig("doc", limit=n)}),
        "set_override": lambda n: ledger.set_override("doc", n, reason="huge"),
        "set_key_limit": lambda n: ledger.set_key_limit("doc:1", n, reason="huge"),
    }
    with pytest.raises(InvalidConfig, match=str(SLOT_LIMIT_MAX)):
        calls[where](EXCLUSIVE_COST)
    calls[where](SLOT_LIMIT_MAX)  # the largest limit is fine


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT INTO keyed_names (name, slot_limit) VALUES ('doc', 1073741824)",
        "INSERT INTO keyed_overrides (name, slot_limit, reason, set_at) VALUES ('doc', 1073741824, 'x', now())",
    ],
)
def test_the_database_refuses_a_limit_at_the_exclusive_cost(engine: sa.Engine, sql: str) -> None:
    with pytest.raises(sa.exc.IntegrityError, match="limit_below_exclusive"), engine.begin() as conn:
        conn.execute(sa.text(sql))


def test_an_arrival_cannot_ask_for_the_exclusive_cost_as_a_weight(ledger: Ledger) -> None:
    """A shared arrival's cost stays below the exclusive cost (the mode is chosen by ``concurrency_mode``, never by
    a number): an Arrival with a larger cost is refused before it reaches the database."""
    with pytest.raises(ValueError, match="cost"):
        Arrival("t", key="doc:1", cost=EXCLUSIVE_COST + 1)


# -- Races with real row locks: the two sides never decide at once ------------------------------------------------


def test_a_reader_racing_a_writer_while_the_shards_grow(engine: sa.Engine, ledger: Ledger) -> None:
    """The writer's admission holds every row of its key (row 0 FOR UPDATE); the name goes to two shards meanwhile;
    a reader then waits for the writer's rows and parks — it never takes the new row 1 beside the writer."""
    ledger.configure({"doc": NameConfig("doc", limit=2)})
    with engine.connect() as conn, conn.begin():
        w = admit.admit(conn, Arrival("w", key="doc:1", cost=EXCLUSIVE_COST), holder=HOLDER, lease=30.0)
        assert w.verdict is Verdict.ADMITTED
        ledger.configure({"doc": NameConfig("doc", limit=2, shards=2)})
        r = Side(engine, lambda c: admit.admit(c, Arrival("r", key="doc:1", message={}), holder=HOLDER, lease=30.0))
        r.start()
        wait_until_blocked(engine, r)
    assert r.finish().verdict is Verdict.PARKED  # was ADMITTED on row 1
    assert _claims(engine) == {"w": (0, EXCLUSIVE_COST)}


def test_a_writer_racing_a_reader_on_another_row_while_the_shards_shrink(engine: sa.Engine, ledger: Ledger) -> None:
    """A reader's claim of row 1 is in progress (it holds row 0 FOR KEY SHARE); the name goes back to one shard; a
    writer's admission waits for the reader's transaction, then finds row 1 taken and parks."""
    ledger.configure({"doc": NameConfig("doc", limit=2, shards=2)})
    setup = ledger.admit(Arrival("setup", key="doc:1", message={}))  # makes the key's rows
    assert setup.fence is not None
    ledger.release(Token("setup", 0), setup.fence, Outcome.COMPLETED)
    with engine.connect() as blocker, blocker.begin():
        # Another reader is updating row 0 (FOR NO KEY UPDATE): the next reader's pick skips it and takes row 1.
        blocker.execute(sa.text("SELECT 1 FROM keyed_slots WHERE key = 'doc:1' AND shard = 0 FOR NO KEY UPDATE"))
        with engine.connect() as conn, conn.begin():
            r = admit.admit(conn, Arrival("r", key="doc:1", message={}), holder=HOLDER, lease=30.0)
            assert (r.verdict, r.shard) == (Verdict.ADMITTED, 1)
            blocker.rollback()
            ledger.configure({"doc": NameConfig("doc", limit=2)})
            exclusive = Arrival("w", key="doc:1", cost=EXCLUSIVE_COST, message={})
            w = Side(engine, lambda c: admit.admit(c, exclusive, holder=HOLDER, lease=30.0))
            w.start()
            wait_until_blocked(engine, w)
    assert w.finish().verdict is Verdict.PARKED  # was ADMITTED on row 0 beside the reader on row 1
    assert _claims(engine) == {"r": (1, 1)}
