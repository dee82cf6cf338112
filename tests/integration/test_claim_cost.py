"""What the server does per claim of the fast batch claim (``keyed_claim_many``): a single-shard key's share (the
name, its override, the key's call limit, the key's override, the cap's line) is read once per claim, by the guarded
UPDATE that takes the slot (D1) — and the failover guard of the claim inserts asks once per transaction. Counted
with PostgreSQL's own per-transaction function counters (``track_functions``), on the statement the workers send."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger, Outcome, ReleaseRequest, Token, admit
from celery_keyed.ledger.caps import Caps

HOLDER = "cost:1:aaaa"


def _calls(conn: sa.Connection, function: str) -> int:
    return int(conn.execute(sa.text(f"SELECT pg_stat_get_xact_function_calls('{function}'::regproc)")).scalar() or 0)


def _claim_in_one_transaction(engine: sa.Engine, arrivals: list[Arrival]) -> tuple[list[Any], int, int]:
    """``claim_many`` of ``arrivals`` in a transaction counting PL/pgSQL calls: (decisions, share reads, guard asks)."""
    with engine.begin() as conn:
        conn.execute(sa.text("SET LOCAL track_functions = 'pl'"))
        # the counters also hold the calls of earlier transactions of this backend not yet flushed: the difference
        before = _calls(conn, "keyed_key_limit"), _calls(conn, "keyed_failover_holding")
        decided = admit.claim_many(conn, arrivals, holder=HOLDER, lease=30.0)
        after = _calls(conn, "keyed_key_limit"), _calls(conn, "keyed_failover_holding")
        return decided, after[0] - before[0], after[1] - before[1]


def test_a_claim_reads_its_keys_share_once_and_the_failover_guard_asks_once_per_transaction(
    engine: sa.Engine,
) -> None:
    ledger = Ledger(engine, holder=HOLDER, lease=30.0)
    ledger.caps = Caps(engine, ttl=float("inf"))
    keys = [f"cost:{i}" for i in range(3)]
    warm = [Arrival(task_id=f"warm-{k}", attempt=0, key=k, task_name="t") for k in keys]
    fences = [a.fence for a in ledger.admit_many(warm)]  # the keys' rows exist (warm keys)
    done = zip(warm, fences, strict=True)
    ledger.release_many([ReleaseRequest(Token(a.task_id, 0), f, Outcome.COMPLETED) for a, f in done])

    arrivals = [Arrival(task_id=f"t-{k}", attempt=0, key=k, task_name="t") for k in keys]
    decided, share_reads, guard_asks = _claim_in_one_transaction(engine, arrivals)
    assert [d[0] is not None and d[0].fence is not None for d in decided] == [True, True, True]
    assert share_reads == 3  # one per claim (a SELECT ... FOR UPDATE and the UPDATE's guard read it twice)
    assert guard_asks == 1  # the first claim insert of the transaction asks; the others commit with it

    # A full key is refused by the same guarded statement, without a second read.
    full = [Arrival(task_id="t-full", attempt=0, key=keys[0], task_name="t")]
    decided, share_reads, _ = _claim_in_one_transaction(engine, full)
    assert decided[0][0] is None
    assert share_reads == 1
    with engine.connect() as conn:
        used = conn.execute(sa.text("SELECT used FROM keyed_slots WHERE key = :k"), {"k": keys[0]}).scalar()
    assert used == 1  # K = 1: the claim above holds it, the refused one took nothing


def test_a_batch_writes_its_claims_in_one_statement_and_reads_a_names_layout_once(engine: sa.Engine) -> None:
    """PostgreSQL sets up a table's CHECK constraints once per statement (keyed_claims has eleven): a batch's claims
    go in one INSERT, not one per claim. Its keys' name is looked up once, not once per key. Counted by a
    statement-level trigger and the function counters, in one transaction rolled back after."""
    ledger = Ledger(engine, holder=HOLDER, lease=30.0)
    ledger.caps = Caps(engine, ttl=float("inf"))
    keys = [f"stmt:{i}" for i in range(4)]
    warm = [Arrival(task_id=f"warm-{k}", attempt=0, key=k, task_name="t") for k in keys]
    fences = [a.fence for a in ledger.admit_many(warm)]
    ledger.release_many([ReleaseRequest(Token(a.task_id, 0), f, Outcome.COMPLETED)
                         for a, f in zip(warm, fences, strict=True)])
    arrivals = [Arrival(task_id=f"s-{k}", attempt=0, key=k, task_name="t") for k in keys]
    conn = engine.connect()
    try:
        with conn.begin() as tx:
            conn.execute(sa.text("SET LOCAL track_functions = 'pl'"))
            conn.execute(sa.text("CREATE TEMP TABLE claim_statements (n integer) ON COMMIT DROP"))
            conn.execute(sa.text(
                "CREATE FUNCTION count_claim_statements() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN INSERT INTO claim_statements VALUES (1); RETURN NULL; END $$"
            ))
            conn.execute(sa.text(
                "CREATE TRIGGER count_claim_statements AFTER INSERT ON keyed_claims "
                "FOR EACH STATEMENT EXECUTE FUNCTION count_claim_statements()"
            ))
            before = _calls(conn, "keyed_name_shards")
            decided = admit.claim_many(conn, arrivals, holder=HOLDER, lease=30.0)
            name_reads = _calls(conn, "keyed_name_shards") - before
            statements = conn.execute(sa.text("SELECT count(*) FROM claim_statements")).scalar()
            rows = conn.execute(
                sa.text("SELECT task_id, fence, shard FROM keyed_claims WHERE task_id = ANY(:ids) ORDER BY task_id"),
                {"ids": [a.task_id for a in arrivals]},
            ).all()
            tx.rollback()
    finally:
        conn.close()
    assert [d[0] is not None and d[0].fence is not None for d in decided] == [True] * 4
    assert statements == 1  # one INSERT for the four claims
    assert name_reads == 1  # one name ("stmt") for four keys
    # each answer is the claim written: its fence and shard
    by_id = {row.task_id: (row.fence, row.shard) for row in rows}
    assert {a.task_id: (d[0].fence, d[0].shard) for a, d in zip(arrivals, decided, strict=True)} == by_id
