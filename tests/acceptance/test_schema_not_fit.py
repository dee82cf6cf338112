"""A ledger whose schema the worker cannot use (a function missing: a deploy that ran ahead of `keyed migrate`, a
privilege revoked) is an infrastructure fault, like an unreachable ledger: keyed tasks are held and run once it is
fixed — never booked as rejected with a `KeyedRejected` result for a fault that is not theirs (real worker)."""

from __future__ import annotations

import time

import sqlalchemy as sa

from tests.acceptance.conftest import Cluster

LIMIT = "keyed_key_limit(text, timestamptz)"  # every admission reads a key's limit through it


def test_a_schema_the_worker_cannot_use_holds_keyed_tasks(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=2)
    assert producer.hold.delay("acct:1", 0.05, note="before").get(timeout=60) == "before"
    with cluster.engine.begin() as conn:
        definition = conn.execute(sa.text(f"SELECT pg_get_functiondef('{LIMIT}'::regprocedure)")).scalar_one()
        conn.execute(sa.text(f"DROP FUNCTION {LIMIT}"))
    try:
        held = producer.hold.delay("acct:2", 0.05, note="held")
        deadline = time.monotonic() + 20
        while "keyed_key_limit" not in cluster.logs["w1"].read_text():  # the worker met the missing function
            assert time.monotonic() < deadline, "the worker never tried to admit the task"
            time.sleep(0.2)
        time.sleep(1.0)
        # Was: booked rejected, its result a KeyedRejected naming UndefinedFunction.
        assert cluster.scalar("SELECT count(*) FROM keyed_tasks WHERE outcome = 'rejected'") == 0
        assert not held.ready(), (held.state, held.result)
    finally:
        with cluster.engine.begin() as conn:
            conn.execute(sa.text(definition))
    assert held.get(timeout=90) == "held"  # held, then admitted once the schema is whole again
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome = 'completed'", 2)
    assert cluster.scalar("SELECT count(*) FROM keyed_tasks WHERE outcome = 'rejected'") == 0
