"""Keyed tasks inside Celery's canvas (chain, group, chord) with real prefork workers, a real Redis broker and result
backend and a real Postgres ledger: whatever the gate decides for a member — admitted, parked then run, rejected
(``max_waiting``), expired (``max_wait``), superseded, debounced away, refused at send, revoked while waiting —
the chain goes on or fails as Celery's own chains do for a failed member, the group's results all complete, and the
chord's body is called or errored: nothing waits for ever (docs/canvas.md has the table these tests check).

One cluster (one worker) serves every case; each case has keys of its own."""

from __future__ import annotations

import gc
import itertools
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import chain, chord, group
from celery.exceptions import ChordError

from celery_keyed import KeyedExpired, KeyedRejected, KeyedRevoked, KeyedSuperseded
from celery_keyed.contrib.pytest import _close_backend
from tests.acceptance.conftest import Cluster, make_cluster

#: Names of the cases' keys: a mutex (no entry), no waiting room, a latest start, supersede, refused at send.
LIMITS = {
    "cvr": {"limit": 1, "max_waiting": 0},
    "cvx": {"limit": 1, "max_wait": 0.5},
    "cvs": {"limit": 1, "overflow": "supersede"},
    "cvf": {"limit": 1, "max_waiting": 0},
}

#: The name of each outcome's keys (the others: "cva", a mutex).
PREFIX = {"rejected": "cvr", "expired": "cvx", "superseded": "cvs", "refused_at_send": "cvf"}

#: What the member's result is, per outcome (None: it runs and returns its note "x").
FAILS_WITH: dict[str, type[Exception] | None] = {
    "admitted": None,
    "parked": None,
    "rejected": KeyedRejected,
    "expired": KeyedExpired,
    "superseded": KeyedSuperseded,
    "debounced": KeyedSuperseded,
    "refused_at_send": KeyedRejected,
    "revoked": KeyedRevoked,
}

#: Seconds a case waits for a result or an errback (everything it waits for takes a few seconds).
WAIT = 30.0

_cases = itertools.count()


@pytest.fixture(scope="module")
def canvas_cluster(
    postgres_server: Any, keyed_template: str, redis_server: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    from tests.conftest import _create_database, _drop_database

    name = f"t_cv_{uuid.uuid4().hex[:10]}"
    url = _create_database(postgres_server, name, template=keyed_template)
    broker = redis_server.url_for(15)
    import redis

    client = redis.Redis.from_url(broker)
    client.flushdb()
    client.close()
    tmp: Path = tmp_path_factory.mktemp("canvas")
    try:
        for cluster in make_cluster(url, broker, tmp, LIMITS):
            cluster.start_worker("w1", concurrency=4)
            yield cluster
    finally:
        _drop_database(postgres_server, name)


@pytest.fixture(scope="module")
def app(canvas_cluster: Cluster) -> Iterator[Any]:
    from celery_keyed.publisher import close_publisher
    from tests.acceptance.proj import make_app

    ns = make_app(canvas_cluster.env)
    yield ns
    # A result object collected after the session's Redis has stopped would unsubscribe from it and fail (an error
    # at interpreter exit): forget the subscriptions, then close.
    gc.collect()
    consumer = getattr(ns.app.backend, "result_consumer", None)
    if consumer is not None:
        consumer.subscribed_to.clear()
    _close_backend(ns.app.backend)
    close_publisher(ns.app)
    ns.app.close()


class Case:
    """One case: its keys, its member signature, and what to do around the canvas's send (a blocker holding the
    key, a newer call that replaces the member)."""

    def __init__(self, cluster: Cluster, app: Any, outcome: str) -> None:
        self.cluster, self.app, self.outcome = cluster, app, outcome
        self.case = f"{outcome}-{next(_cases)}-{uuid.uuid4().hex[:6]}"
        prefix = PREFIX.get(outcome, "cva")
        self.key = f"{prefix}:{self.case}"

    def member(self) -> Any:
        app, key = self.app, self.key
        if self.outcome == "superseded":
            return app.cv_doc.si(key, "d", "x")
        if self.outcome == "debounced":
            return app.cv_debounced.si(key, "x")
        if self.outcome == "refused_at_send":
            return app.cv_feed.si(key, "x")
        return app.cv_step.si(key, "x")

    def before(self) -> None:
        """A blocker holding the key while the member arrives (parked, rejected, expired, superseded)."""
        if self.outcome in ("parked", "rejected", "expired", "superseded", "revoked"):
            self.app.cv_step.delay(self.key, "blocker", 2.0)
            self.cluster.wait_for(
                "SELECT count(*) FROM observed WHERE kind = 'start' AND key = :k", 1, k=self.key, timeout=60
            )

    def after(self) -> None:
        """A newer call that replaces the parked member (superseded, debounced), or its revoke (revoked)."""
        if self.outcome == "revoked":
            self.cluster.wait_for("SELECT count(*) FROM keyed_waiting WHERE key = :k", 1, k=self.key, timeout=WAIT)
            parked = self.cluster.scalar("SELECT task_id FROM keyed_waiting WHERE key = :k", k=self.key)
            self.app.app.control.revoke(parked)
            return
        if self.outcome in ("superseded", "debounced"):
            self.cluster.wait_for("SELECT count(*) FROM keyed_waiting WHERE key = :k", 1, k=self.key, timeout=WAIT)
            newer = self.app.cv_doc.delay(self.key, "d", "newer") if self.outcome == "superseded" else (
                self.app.cv_debounced.delay(self.key, "newer")
            )
            assert newer.get(timeout=WAIT) == "newer"

    def errbacks(self) -> list[str]:
        return [r.task_id for r in self.cluster.rows(
            "SELECT task_id FROM observed WHERE kind = 'errback' AND key = :c ORDER BY at", c=self.case)]

    def started(self, note: str) -> int:
        return int(self.cluster.scalar(
            "SELECT count(*) FROM observed WHERE kind = 'start' AND key IN (:c, :k) AND note = :n",
            c=self.case, k=self.key, n=note))


OUTCOMES = list(FAILS_WITH)


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_chain(canvas_cluster: Cluster, app: Any, outcome: str) -> None:
    """head | member | tail: the member is sent by the worker when the head has finished. A member that never runs
    fails the chain as a failed body would: the chain's result raises its Keyed… error, the tail never runs, the
    chain's errback is called once, for the member."""
    case = Case(canvas_cluster, app, outcome)
    case.before()
    canvas = chain(app.cv_tail.si(case.case, "head"), case.member(), app.cv_tail.si(case.case, "tail"))
    canvas.link_error(app.cv_errback.s(case.case))
    result = canvas.apply_async()
    case.after()
    expected = FAILS_WITH[outcome]
    if expected is None:
        assert result.get(timeout=WAIT) == "tail"
        assert case.started("x") == 1 and case.errbacks() == []
        return
    # Fresh results, without the parents the caller's result object holds: what any reader of the backend sees.
    tail, member = app.app.AsyncResult(result.id), app.app.AsyncResult(result.parent.id)
    with pytest.raises(expected):
        tail.get(timeout=WAIT)
    with pytest.raises(expected):
        member.get(timeout=WAIT)
    canvas_cluster.wait_for(
        "SELECT count(*) FROM observed WHERE kind = 'errback' AND key = :c", 1, c=case.case, timeout=WAIT)
    assert case.errbacks() == [member.id]
    assert case.started("tail") == 0 and case.started("x") == 0


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_group(canvas_cluster: Cluster, app: Any, outcome: str) -> None:
    """group(member, other): every result completes; the member's is its Keyed… error when it never ran."""
    case = Case(canvas_cluster, app, outcome)
    case.before()
    result = group(case.member(), app.cv_tail.si(case.case, "other")).apply_async()
    case.after()
    values = result.join(timeout=WAIT, propagate=False)
    expected = FAILS_WITH[outcome]
    assert values[1] == "other"
    if expected is None:
        assert values[0] == "x"
    else:
        assert isinstance(values[0], expected), values[0]
        assert case.started("x") == 0


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_chord(canvas_cluster: Cluster, app: Any, outcome: str) -> None:
    """chord([member, other], body): the body runs with both results, or — when the member never ran — the chord
    fails with Celery's ChordError naming the member's Keyed… error, and the body's errback is called."""
    case = Case(canvas_cluster, app, outcome)
    case.before()
    body = app.cv_body.s(case.case).on_error(app.cv_errback.s(case.case))
    result = chord([case.member(), app.cv_tail.si(case.case, "other")], body).apply_async()
    case.after()
    expected = FAILS_WITH[outcome]
    if expected is None:
        assert sorted(result.get(timeout=WAIT)) == ["other", "x"]
        return
    with pytest.raises(ChordError) as failed:
        app.app.AsyncResult(result.id).get(timeout=WAIT)  # the body's own result, as any reader of the backend sees it
    assert expected.__name__ in str(failed.value)
    canvas_cluster.wait_for(
        "SELECT count(*) FROM observed WHERE kind = 'errback' AND key = :c", 1, c=case.case, timeout=WAIT)
    assert case.errbacks() == [result.id]
    assert case.started(json.dumps(["x", "other"])) == 0 and case.started("x") == 0


def test_refused_at_send_as_the_first_step_of_a_chain(canvas_cluster: Cluster, app: Any) -> None:
    """The caller sends the first step: the chain's send answers a result instead of raising, and the whole chain is
    failed with ``KeyedRejected`` (nothing published for it); a plain send of the same task still raises."""
    case = Case(canvas_cluster, app, "refused_at_send")
    canvas = chain(case.member(), app.cv_tail.si(case.case, "tail"))
    canvas.link_error(app.cv_errback.s(case.case))
    result = canvas.apply_async()
    with pytest.raises(KeyedRejected):
        app.app.AsyncResult(result.id).get(timeout=WAIT)
    canvas_cluster.wait_for(
        "SELECT count(*) FROM observed WHERE kind = 'errback' AND key = :c", 1, c=case.case, timeout=WAIT)
    assert case.errbacks() == [result.parent.id]
    assert case.started("tail") == 0 and case.started("x") == 0
    with pytest.raises(KeyedRejected):
        app.cv_feed.delay(case.key, "plain")
