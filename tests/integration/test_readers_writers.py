"""Readers and writers per key on real Postgres (issue 14 item 6): shared attempts of a key run together up to K, an
exclusive attempt (cost ``EXCLUSIVE_COST``) runs alone on its key, FIFO across modes (a waiting writer is not
starved by a stream of readers), the bound holds through limit changes, and the books balance."""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa

from celery_keyed.ledger import (
    EXCLUSIVE_COST,
    Admission,
    Arrival,
    Ledger,
    NameConfig,
    Outcome,
    Promotion,
    Token,
    Verdict,
    admit,
    release,
)
from celery_keyed.ledger.reconcile import check_counters_once
from tests.integration.test_races import HOLDER, LEASE, Side, count, wait_until_blocked


def reader(ledger: Ledger, task_id: str, key: str = "doc:1", **kw) -> Admission:
    return ledger.admit(Arrival(task_id, key=key, message={"id": task_id}, **kw))


def writer(ledger: Ledger, task_id: str, key: str = "doc:1", **kw) -> Admission:
    return ledger.admit(Arrival(task_id, key=key, cost=EXCLUSIVE_COST, message={"id": task_id}, **kw))


def used(scalar: Callable[..., object], key: str = "doc:1") -> int:
    return int(scalar("SELECT COALESCE(sum(used), 0) FROM keyed_slots WHERE key = :key", key=key) or 0)


def finish(ledger: Ledger, task_id: str, fence: int) -> list[Promotion]:
    return ledger.release(Token(task_id, 0), fence, Outcome.COMPLETED).promotions


def run(ledger: Ledger, promotion: Promotion) -> int:
    """Bind a promotion as its receiving worker would (D5): its fence."""
    assert promotion.nonce is not None
    fence = ledger.bind(Token(promotion.task_id, promotion.attempt), promotion.nonce)
    assert fence is not None
    return fence


def running(scalar: Callable[..., object], key: str = "doc:1") -> set[str]:
    with_rows = scalar("SELECT string_agg(task_id, ',' ORDER BY task_id) FROM keyed_claims WHERE key = :key", key=key)
    return set(str(with_rows).split(",")) if with_rows else set()


def test_shared_attempts_run_together_up_to_the_limit(ledger: Ledger, scalar) -> None:
    ledger.configure({"doc": NameConfig("doc", limit=3)})
    verdicts = [reader(ledger, f"r{i}").verdict for i in range(4)]
    assert verdicts == [Verdict.ADMITTED] * 3 + [Verdict.PARKED]
    assert used(scalar) == 3


def test_an_exclusive_attempt_waits_for_the_readers_and_runs_alone(ledger: Ledger, scalar) -> None:
    ledger.configure({"doc": NameConfig("doc", limit=3)})
    r1, r2 = reader(ledger, "r1"), reader(ledger, "r2")
    assert writer(ledger, "w").verdict is Verdict.PARKED  # two readers run: room for one more reader, not a writer
    assert finish(ledger, "r1", r1.fence) == []  # one reader still runs
    (p,) = finish(ledger, "r2", r2.fence)  # the key is idle: the writer starts
    assert p.task_id == "w"
    assert used(scalar) == EXCLUSIVE_COST
    w_fence = run(ledger, p)
    # Nothing else of the key starts while it runs: neither a reader nor another writer.
    assert reader(ledger, "r3").verdict is Verdict.PARKED
    assert writer(ledger, "w2").verdict is Verdict.PARKED
    assert running(scalar) == {"w"}
    promoted = finish(ledger, "w", w_fence)
    assert [x.task_id for x in promoted] == ["r3"]  # FIFO: r3 arrived before w2; w2 waits for r3
    assert used(scalar) == 1
    (p2,) = finish(ledger, "r3", run(ledger, promoted[0]))
    assert p2.task_id == "w2"
    finish(ledger, "w2", run(ledger, p2))
    assert used(scalar) == 0
    assert check_counters_once(ledger.engine) == []
    assert ledger.books() == {"completed": 5, "arrivals": 5}


def test_an_idle_key_admits_a_writer_at_once(ledger: Ledger, scalar) -> None:
    ledger.configure({"doc": NameConfig("doc", limit=3)})
    w = writer(ledger, "w")
    assert w.verdict is Verdict.ADMITTED
    assert used(scalar) == EXCLUSIVE_COST
    assert reader(ledger, "r").verdict is Verdict.PARKED
    (p,) = finish(ledger, "w", w.fence)
    assert p.task_id == "r" and used(scalar) == 1


def test_readers_behind_a_waiting_writer_wait_no_starvation(ledger: Ledger, scalar) -> None:
    """A stream of readers never passes a waiting writer (FIFO across modes, D10): readers that arrive after it
    park, though the key has room for them, and start only after the writer ran."""
    ledger.configure({"doc": NameConfig("doc", limit=3)})
    r0 = reader(ledger, "r0")
    assert writer(ledger, "w").verdict is Verdict.PARKED
    later = [reader(ledger, f"r{i}") for i in range(1, 6)]
    assert [a.verdict for a in later] == [Verdict.PARKED] * 5  # room for two more readers, kept for the writer
    assert used(scalar) == 1
    (p,) = finish(ledger, "r0", r0.fence)
    assert p.task_id == "w"
    promoted = finish(ledger, "w", run(ledger, p))
    assert [x.task_id for x in promoted] == ["r1", "r2", "r3"]  # then the readers, K of them together
    assert used(scalar) == 3


def test_a_writer_in_line_keeps_its_place_behind_earlier_readers(ledger: Ledger, scalar) -> None:
    """Readers that arrived before the writer run before it; those after it, after it."""
    ledger.configure({"doc": NameConfig("doc", limit=1)})
    r0 = reader(ledger, "r0")
    assert reader(ledger, "r1").verdict is Verdict.PARKED
    assert writer(ledger, "w").verdict is Verdict.PARKED
    assert reader(ledger, "r2").verdict is Verdict.PARKED
    order = []
    promoted = finish(ledger, "r0", r0.fence)
    while promoted:
        (p,) = promoted
        order.append(p.task_id)
        promoted = finish(ledger, p.task_id, run(ledger, p))
    assert order == ["r1", "w", "r2"]
    assert ledger.books() == {"completed": 4, "arrivals": 4}


def test_raising_the_limit_while_a_writer_runs_lets_nobody_in(ledger: Ledger, scalar) -> None:
    ledger.configure({"doc": NameConfig("doc", limit=2)})
    w = writer(ledger, "w")
    ledger.set_override("doc", 50, reason="more readers")
    assert reader(ledger, "r").verdict is Verdict.PARKED
    ledger.sweep()
    assert running(scalar) == {"w"}
    (p,) = finish(ledger, "w", w.fence)
    assert p.task_id == "r"


def test_lowering_the_limit_while_a_writer_runs_keeps_the_books(ledger: Ledger, scalar) -> None:
    """The release gives back what the claim took (its row's cost), whatever the limit became (CHECK used >= 0)."""
    ledger.configure({"doc": NameConfig("doc", limit=3)})
    w = writer(ledger, "w")
    assert reader(ledger, "r").verdict is Verdict.PARKED
    ledger.set_override("doc", 1, reason="fewer")
    (p,) = finish(ledger, "w", w.fence)
    assert p.task_id == "r" and used(scalar) == 1
    ledger.set_override("doc", 0, reason="pause")
    finish(ledger, "r", run(ledger, p))
    assert used(scalar) == 0
    assert writer(ledger, "w2").verdict is Verdict.PARKED  # paused: a writer waits too
    assert check_counters_once(ledger.engine) == []


def test_an_exclusive_attempt_is_refused_where_it_can_never_run_alone(ledger: Ledger) -> None:
    ledger.configure({"hot": NameConfig("hot", limit=8, shards=4)})
    refused = writer(ledger, "w", key="hot:1")
    assert refused.verdict is Verdict.REJECTED and "sharded" in refused.detail
    two = ledger.admit(Arrival("w2", key="doc:1", extra_keys=("doc:2",), cost=EXCLUSIVE_COST))
    assert two.verdict is Verdict.REJECTED and "one concurrency key" in two.detail
    assert ledger.books() == {"rejected": 2, "arrivals": 2}


def test_the_fast_paths_never_admit_a_writer_next_to_a_reader(ledger: Ledger, scalar) -> None:
    """admit_many (keyed_claim_many) and the plain paths leave a writer to the general path; the batch of readers
    still goes through them."""
    ledger.configure({"doc": NameConfig("doc", limit=3)})
    got = ledger.admit_many(
        [
            Arrival("r1", key="doc:1", message={}),
            Arrival("w", key="doc:1", cost=EXCLUSIVE_COST, message={}),
            Arrival("r2", key="doc:1", message={}),
        ]
    )
    assert [a.verdict for a in got] == [Verdict.ADMITTED, Verdict.PARKED, Verdict.PARKED]
    assert used(scalar) == 1


def test_a_reader_racing_a_writer_for_an_idle_key(engine: sa.Engine, ledger: Ledger, scalar) -> None:
    """The writer's admission holds the key's slot row; a reader arriving meanwhile waits for that lock and then
    parks (the writer holds the key) — never both running."""
    ledger.configure({"doc": NameConfig("doc", limit=3)})
    with engine.connect() as conn, conn.begin():
        w = admit.admit(conn, Arrival("w", key="doc:1", cost=EXCLUSIVE_COST), holder=HOLDER, lease=LEASE)
        assert w.verdict is Verdict.ADMITTED
        r = Side(engine, lambda c: admit.admit(c, Arrival("r", key="doc:1", message={}), holder=HOLDER, lease=LEASE))
        r.start()
        wait_until_blocked(engine, r)
    assert r.finish().verdict is Verdict.PARKED
    assert count(engine, "SELECT count(*) FROM keyed_claims WHERE key = 'doc:1'") == 1


def test_a_writer_racing_a_reader_for_an_idle_key(engine: sa.Engine, ledger: Ledger, scalar) -> None:
    """The reader's admission first (holding the slot row): the writer waits for the lock, sees used = 1, parks."""
    ledger.configure({"doc": NameConfig("doc", limit=3)})
    reader(ledger, "r0")
    with engine.connect() as conn, conn.begin():
        conn.execute(sa.text("SELECT 1 FROM keyed_slots WHERE key = 'doc:1' FOR UPDATE"))
        r = admit.admit(conn, Arrival("r", key="doc:1", message={}), holder=HOLDER, lease=LEASE)
        assert r.verdict is Verdict.ADMITTED
        exclusive = Arrival("w", key="doc:1", cost=EXCLUSIVE_COST)
        w = Side(engine, lambda c: admit.admit(c, exclusive, holder=HOLDER, lease=LEASE))
        w.start()
        wait_until_blocked(engine, w)
    assert w.finish().verdict is Verdict.PARKED
    assert running(scalar) == {"r0", "r"}


def test_a_release_racing_a_reader_hands_the_key_to_the_waiting_writer(
    engine: sa.Engine, ledger: Ledger, scalar
) -> None:
    """The last reader's release holds the slot row; a new reader arriving then waits for it, and finds the
    writer promoted (FIFO: the freed key belongs to the head of the line)."""
    ledger.configure({"doc": NameConfig("doc", limit=3)})
    r0 = reader(ledger, "r0")
    assert writer(ledger, "w").verdict is Verdict.PARKED
    with engine.connect() as conn, conn.begin():
        report = release.release(conn, Token("r0", 0), r0.fence, Outcome.COMPLETED)
        assert [p.task_id for p in report.promotions] == ["w"]
        r = Side(engine, lambda c: admit.admit(c, Arrival("r1", key="doc:1", message={}), holder=HOLDER, lease=LEASE))
        r.start()
        wait_until_blocked(engine, r)
    assert r.finish().verdict is Verdict.PARKED
    assert running(scalar) == {"w"} and used(scalar) == EXCLUSIVE_COST


def test_explain_and_status_show_the_mode_and_count_a_writer_once(engine: sa.Engine, ledger: Ledger) -> None:
    from celery_keyed.ledger import status_keys, status_names

    ledger.configure({"doc": NameConfig("doc", limit=3)})
    w = writer(ledger, "w")
    reader(ledger, "r")
    writer(ledger, "w2")
    running_w = ledger.explain("w")
    assert running_w.state == "running" and running_w.facts["mode"] == "exclusive"
    assert "all of key doc:1" in running_w.text
    waiting_r, waiting_w2 = ledger.explain("r"), ledger.explain("w2")
    assert waiting_r.facts["mode"] == "shared" and "(in flight 1/3)" in waiting_r.text
    assert waiting_w2.facts["mode"] == "exclusive" and "to run alone" in waiting_w2.text
    with engine.connect() as conn:
        (key,) = status_keys(conn, name="doc")
        (name,) = status_names(conn, name="doc")
    assert key.in_flight == 1 and key.waiting == 2 and name.in_flight == 1
    finish(ledger, "w", w.fence)


def test_threads_mixing_readers_and_writers_never_break_the_rule(engine: sa.Engine, ledger: Ledger, scalar) -> None:
    """Four threads admit, run and release a random mix of readers and writers on one key (K = 3), each through
    the ledger's own calls on its own connections; a finished attempt's promotions are bound and run by the thread
    that released it. At every start the claims of the key are at most K readers or one writer alone; at the end
    nothing is held or waiting and the books balance."""
    import random
    import threading
    import time

    ledger.configure({"doc": NameConfig("doc", limit=3)})
    per_thread, threads = 25, 4
    errors: list[str] = []

    def check() -> None:
        with engine.connect() as conn:
            n, writers = conn.execute(
                sa.text("SELECT count(*), count(*) FILTER (WHERE cost >= :x) FROM keyed_claims WHERE key = 'doc:1'"),
                {"x": EXCLUSIVE_COST},
            ).one()
        if n > 3 or (writers and n != 1):
            errors.append(f"{n} claims with {writers} writers")

    def run_and_finish(task_id: str, fence: int) -> None:
        check()
        time.sleep(0.003)  # the body: long enough for the threads' attempts to overlap
        for p in finish(ledger, task_id, fence):
            run_and_finish(p.task_id, run(ledger, p))

    def work(t: int) -> None:
        rnd = random.Random(t)
        for i in range(per_thread):
            task_id = f"t{t}-{i}"
            cost = EXCLUSIVE_COST if rnd.random() < 0.25 else 1
            got = ledger.admit(Arrival(task_id, key="doc:1", cost=cost, message={}))
            if got.admitted:
                run_and_finish(task_id, got.fence)

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(timeout=120)
    # Whatever is still parked runs now (its promotions were dispatched to the thread that released).
    for _ in range(per_thread * threads):
        left = scalar("SELECT task_id FROM keyed_claims WHERE key = 'doc:1' LIMIT 1")
        if left is None:
            break
        c = ledger.explain(str(left)).facts
        fence = c["fence"] if c.get("state") == "running" else None
        if fence is None:
            nonce = scalar("SELECT nonce FROM keyed_claims WHERE task_id = :t", t=left)
            fence = ledger.bind(Token(str(left), 0), nonce)
        run_and_finish(str(left), fence)
    assert errors == []
    assert used(scalar) == 0
    assert scalar("SELECT count(*) FROM keyed_waiting") == 0
    assert ledger.books() == {"completed": per_thread * threads, "arrivals": per_thread * threads}
    assert check_counters_once(engine) == []
