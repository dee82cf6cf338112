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
