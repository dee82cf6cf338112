"""A group head's release batched with a release that promotes a multi-key waiter (the demo's stalled order).

``Ledger.release_many`` releases claims without a group in one call and leaves grouped claims to the general
path. A promotion is reported by the request that gave back a slot on its key; a multi-key waiter (``tenant:t``
+ ``api``) parked in the line of ``api`` is reported under its first key, ``tenant:t``, which no request of the
batch freed. Such a promotion used to be attached to the batch's first request whatever it was — and when that
was a grouped claim, a report ``released=True`` was made up for it, so its own release never ran: its claim
stayed until the lease lapsed, and its group (an order's later events, or the head's retry) waited a lease and
then for reconcile. Seen in the demo as a makespan of 23-43u instead of ~7u.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, ReleaseRequest, Token, Verdict

HOLDER = "group-heads:1:aaaa"


@pytest.fixture
def ledger(engine: sa.Engine) -> Ledger:
    return Ledger(engine, holder=HOLDER, lease=30.0, dispatch=10.0)


def value(engine: sa.Engine, sql: str, **params: object) -> object:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def touch(ledger: Ledger, keys: list[str]) -> None:
    """Create the keys' rows (first use takes the general path)."""
    for key in keys:
        a = ledger.admit(Arrival(f"touch-{key}", key=key))
        assert a.fence is not None
        assert ledger.release(Token(f"touch-{key}", 0), a.fence, Outcome.COMPLETED).released


@pytest.mark.parametrize("contended", [False, True], ids=["uncontended", "contended"])
@pytest.mark.parametrize("outcome", [Outcome.RETRY, Outcome.COMPLETED])
def test_a_group_heads_release_batched_with_a_multi_key_promotion_is_not_skipped(
    engine: sa.Engine, ledger: Ledger, outcome: Outcome, contended: bool
) -> None:
    ledger.configure({"api": NameConfig("api", limit=1), "tenant": NameConfig("tenant", limit=3)})
    touch(ledger, ["tenant:t1", "tenant:t2", "api"])
    # The head of order:1 runs (a group key only, as the demo's order events).
    head = ledger.admit(Arrival("paid", group_key="order:1"))
    assert head.verdict is Verdict.ADMITTED and head.fence is not None
    # A partner-API call holds the api gate's only slot; another tenant's call waits in api's line.
    call = ledger.admit(Arrival("t1-call", key="tenant:t1", extra_keys=("api",)))
    assert call.verdict is Verdict.ADMITTED and call.fence is not None
    waiter = ledger.admit(Arrival("t2-call", key="tenant:t2", extra_keys=("api",), queue="q", message={"task": "x"}))
    assert waiter.verdict is Verdict.PARKED

    reports = ledger.release_many(
        [
            ReleaseRequest(Token("paid", 0), head.fence, outcome, contended=contended),  # grouped: general path
            ReleaseRequest(Token("t1-call", 0), call.fence, Outcome.COMPLETED, contended=contended),
        ]
    )

    # The head's own release ran: its claim is gone, the group is free for its next attempt or member...
    assert value(engine, "SELECT count(*) FROM keyed_claims WHERE task_id = 'paid'") == 0
    assert [r.released for r in reports] == [True, True]
    # ...and the call's release promoted the waiter (reported under its first key, tenant:t2, which no request
    # of the batch freed: by the request that freed the api slot).
    assert [p.task_id for r in reports for p in r.promotions] == ["t2-call"]
    assert reports[1].promotions and not reports[0].promotions
    if outcome is Outcome.COMPLETED:
        assert reports[0].finished == [("paid", "completed")]
        assert value(engine, "SELECT outcome FROM keyed_tasks WHERE task_id = 'paid'") == "completed"
    else:
        retry = ledger.admit(Arrival("paid", attempt=1, group_key="order:1"))
        assert retry.verdict is Verdict.ADMITTED, retry
