"""Limits computed from the call with real workers: two prefork workers (6 pool processes), real Redis, real
Postgres and the independent observer (the ``observed`` table the tasks write). ``acceptance.tenant_job`` declares
``concurrency_limit=lambda plan, **_: PLAN_LIMITS[plan]``: a premium tenant's key runs 3 at once, a basic tenant's
1, while the name's configured limit is 1. A tenant that upgrades runs 3 at once from its next call on (the latest
arrival's limit holds); an operator's key override wins over the call; a foreign message whose header claims a limit
of 50 runs under the declared one. Every task has one outcome and the books balance."""

from __future__ import annotations

import pytest

from tests.acceptance.conftest import Cluster, peak_overlap

SERVICE = 0.4


def _peak(cluster: Cluster, key: str, ids: list[str]) -> int:
    wanted = set(ids)
    return peak_overlap([span for span in cluster.intervals(key) if span[0] in wanted])


def _drained(cluster: Cluster, total: int) -> None:
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", total, timeout=150, at_least=True)
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
    cluster.wait_for("SELECT coalesce(sum(used), 0) FROM keyed_slots", 0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cluster", [{"tenant": 1}], indirect=True)
def test_each_tenant_runs_as_many_as_its_plan_says(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=3)
    cluster.start_worker("w2", concurrency=3)
    job = producer.tenant_job
    gold = [job.delay("tenant:gold", "premium", SERVICE).id for _ in range(9)]
    tin = [job.delay("tenant:tin", "basic", SERVICE).id for _ in range(4)]
    _drained(cluster, 13)
    assert _peak(cluster, "tenant:gold", gold) == 3  # the call's limit, reached and never passed
    assert _peak(cluster, "tenant:tin", tin) == 1  # the basic plan's

    # tin upgrades: its next calls say premium. Its key runs 3 at once from then on (the latest arrival's limit).
    upgraded = [job.delay("tenant:tin", "premium", SERVICE).id for _ in range(9)]
    _drained(cluster, 22)
    assert _peak(cluster, "tenant:tin", upgraded) == 3
    assert cluster.scalar("SELECT slot_limit FROM keyed_call_limits WHERE key = 'tenant:tin'") == 3

    # An operator's key limit wins over the call: 2 for gold, whatever its calls say.
    from celery_keyed.ledger import Ledger

    Ledger(cluster.engine).set_key_limit("tenant:gold", 2, reason="incident")
    throttled = [job.delay("tenant:gold", "premium", SERVICE).id for _ in range(8)]
    _drained(cluster, 30)
    assert _peak(cluster, "tenant:gold", throttled) == 2

    # A foreign producer's message (send_task, a forged limit header) runs under the declared limit: basic, 1.
    forged = [
        producer.app.send_task(
            "acceptance.tenant_job", ("tenant:lead", "basic", SERVICE), headers={"keyed_limit": 50}
        ).id
        for _ in range(4)
    ]
    _drained(cluster, 34)
    assert _peak(cluster, "tenant:lead", forged) == 1
    assert cluster.scalar("SELECT slot_limit FROM keyed_call_limits WHERE key = 'tenant:lead'") == 1

    books = dict(cluster.rows("SELECT coalesce(outcome, 'open'), count(*) FROM keyed_tasks GROUP BY 1"))
    assert books == {"completed": 34}, books
