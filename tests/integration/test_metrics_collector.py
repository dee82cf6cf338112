"""Prometheus metrics on a real ledger: the collector's gauges against parked and running rows, its timeout and
its behaviour when the ledger is unreachable, and the drift counter of the reconcile task."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import prometheus_client
import pytest
import sqlalchemy as sa
from celery import Celery
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import celery_keyed
from celery_keyed import beat, metrics
from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict
from celery_keyed.metrics import LedgerCollector
from celery_keyed.publisher import close_publisher


@pytest.fixture
def registry(database_url: str) -> Iterator[CollectorRegistry]:
    registry = CollectorRegistry()
    collector = LedgerCollector(database_url, timeout=1.0)
    registry.register(collector)
    yield registry
    collector.engine.dispose()


def fill(ledger: Ledger) -> None:
    """api (configured 3): api:t1 3 running + 2 parked, api:t2 1 running; account (a mutex by default):
    account:7 1 running + 1 parked; stripe: overridden to 0 (paused), no keys yet."""
    ledger.configure({"api": NameConfig("api", limit=3)})
    verdicts = [ledger.admit(Arrival(f"a{i}", key="api:t1", message={"task": "t"})).verdict for i in range(5)]
    assert verdicts == [Verdict.ADMITTED] * 3 + [Verdict.PARKED] * 2
    assert ledger.admit(Arrival("b0", key="api:t2")).verdict is Verdict.ADMITTED
    assert ledger.admit(Arrival("c0", key="account:7")).verdict is Verdict.ADMITTED
    assert ledger.admit(Arrival("c1", key="account:7", message={"task": "t"})).verdict is Verdict.PARKED
    ledger.set_override("stripe", 0, reason="incident 42", author="alice")


def test_held_groups_per_group_name(registry: CollectorRegistry, ledger: Ledger) -> None:
    """Two groups of "order" held after their heads failed, one of "ship" under the default policy (not held)."""
    from celery_keyed.ledger import groups_register

    ledger.configure({"order": NameConfig("order", group_failure="hold"), "ship": NameConfig("ship")})
    for group, task_id in (("order:1", "o1"), ("order:2", "o2"), ("ship:1", "s1")):
        ledger.transaction(lambda conn, g=group, t=task_id: groups_register(conn, g, t, now=None))
        head = ledger.admit(Arrival(task_id, group_key=group, group_seq=1))
        assert head.fence is not None
        ledger.release(Token(task_id, 0), head.fence, Outcome.FAILED, detail="boom")
    assert registry.get_sample_value("celery_keyed_groups_held", {"name": "order"}) == 2
    assert registry.get_sample_value("celery_keyed_groups_held", {"name": "ship"}) is None
    ledger.resume_group("order:1")
    assert registry.get_sample_value("celery_keyed_groups_held", {"name": "order"}) == 1


def test_collector_gauges_per_name(registry: CollectorRegistry, ledger: Ledger) -> None:
    fill(ledger)
    time.sleep(0.05)  # the parked rows are a little old
    value = registry.get_sample_value
    assert value("celery_keyed_ledger_up") == 1
    assert value("celery_keyed_in_flight", {"name": "api"}) == 4
    assert value("celery_keyed_waiting", {"name": "api"}) == 2
    assert value("celery_keyed_keys", {"name": "api"}) == 2
    assert value("celery_keyed_limit", {"name": "api", "source": "config"}) == 3
    assert value("celery_keyed_in_flight", {"name": "account"}) == 1
    assert value("celery_keyed_waiting", {"name": "account"}) == 1
    assert value("celery_keyed_limit", {"name": "account", "source": "default"}) == 1
    assert value("celery_keyed_limit", {"name": "stripe", "source": "override"}) == 0
    assert value("celery_keyed_paused", {"name": "stripe"}) == 1 and value("celery_keyed_paused", {"name": "api"}) == 0
    assert 0.05 <= value("celery_keyed_oldest_waiting_seconds", {"name": "api"}) < 60
    assert value("celery_keyed_oldest_waiting_seconds", {"name": "stripe"}) == 0  # nothing waits
    assert value("celery_keyed_ledger_scrape_seconds") < 1.0

    # Each scrape reads the ledger afresh: a release that promotes the next waiter moves the gauges.
    with ledger.engine.connect() as conn:
        fence = conn.execute(sa.text("SELECT fence FROM keyed_claims WHERE task_id = 'a0'")).scalar_one()
    report = ledger.release(Token("a0", 0), fence, Outcome.COMPLETED)
    assert [p.task_id for p in report.promotions] == ["a3"]
    assert value("celery_keyed_in_flight", {"name": "api"}) == 4  # a promoted attempt holds its slot
    assert value("celery_keyed_waiting", {"name": "api"}) == 1
    # The exposition is valid Prometheus text.
    text = prometheus_client.generate_latest(registry).decode()
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {"celery_keyed_in_flight", "celery_keyed_waiting", "celery_keyed_oldest_waiting_seconds"} <= names


def test_an_unreachable_ledger_is_reported_not_raised() -> None:
    registry = CollectorRegistry()
    collector = LedgerCollector("postgresql://nobody@127.0.0.1:1/none", timeout=1.0)
    registry.register(collector)
    started = time.monotonic()
    assert registry.get_sample_value("celery_keyed_ledger_up") == 0
    assert registry.get_sample_value("celery_keyed_in_flight", {"name": "api"}) is None
    assert time.monotonic() - started < 5
    collector.engine.dispose()


def test_a_blocked_ledger_query_is_cut_by_the_timeout(database_url: str, ledger: Ledger, engine: sa.Engine) -> None:
    fill(ledger)
    registry = CollectorRegistry()
    collector = LedgerCollector(database_url, timeout=0.5)
    registry.register(collector)
    locked, release = threading.Event(), threading.Event()

    def hold_lock() -> None:  # DDL-grade lock: the status query cannot even read keyed_slots
        with engine.begin() as conn:
            conn.execute(sa.text("LOCK TABLE keyed_slots IN ACCESS EXCLUSIVE MODE"))
            locked.set()
            release.wait(10)

    thread = threading.Thread(target=hold_lock)
    thread.start()
    try:
        assert locked.wait(5)
        started = time.monotonic()
        assert registry.get_sample_value("celery_keyed_ledger_up") == 0
        assert time.monotonic() - started < 3
    finally:
        release.set()
        thread.join()
    assert registry.get_sample_value("celery_keyed_ledger_up") == 1  # and it recovers on the next scrape
    collector.engine.dispose()


def test_for_app_and_describe_do_not_query(database_url: str) -> None:
    app = Celery("metrics-test", broker="memory://", set_as_current=False)
    app.conf.keyed_database_url = database_url
    app.conf.keyed_metrics_timeout = 0.75
    collector = LedgerCollector.for_app(app)
    assert collector.timeout == 0.75
    assert [f.name for f in collector.describe()][:3] == [
        "celery_keyed_in_flight",
        "celery_keyed_waiting",
        "celery_keyed_oldest_waiting_seconds",
    ]
    assert collector.engine.pool.checkedout() == 0 and collector.engine.pool.checkedin() == 0  # never connected
    collector.engine.dispose()


def test_reconcile_task_counts_drift_repaired(database_url: str, engine: sa.Engine, monkeypatch) -> None:
    app = Celery("metrics-test", broker="memory://", set_as_current=False)
    app.conf.keyed_database_url = database_url
    celery_keyed.install(app)
    monkeypatch.setattr(beat, "_last_unreachable", float("-inf"))  # a full reconcile, not only a sweep
    Ledger(engine).admit(Arrival("x", key="k:1"))
    with engine.begin() as conn:  # a counter out of step with the claims that exist (a bug, simulated)
        conn.execute(sa.text("UPDATE keyed_slots SET used = 4 WHERE key = 'k:1'"))
    drift = "celery_keyed_reconcile_drift_repaired_total"
    before = prometheus_client.REGISTRY.get_sample_value(drift) or 0.0
    assert beat.reconcile(app)["drift"] == ["k:1 shard 0: used 4 but 1 claims exist"]
    assert prometheus_client.REGISTRY.get_sample_value(drift) == before + 1
    beat.reconcile(app)  # repaired: nothing more to count
    assert prometheus_client.REGISTRY.get_sample_value(drift) == before + 1
    close_publisher(app)


def test_handoff_hooks_time_a_promotion_to_its_start() -> None:
    """The gate's hooks: a release records when it began for each attempt it promoted; the attempt's start
    observes the latency once (a start nobody timed counts as promoted, observes nothing)."""
    promotion = type("P", (), {"token": Token("h1", 0)})()
    count = "celery_keyed_handoff_seconds_count"
    promoted = ("celery_keyed_admissions_total", {"outcome": "promoted"})
    before = prometheus_client.REGISTRY.get_sample_value(count) or 0.0
    before_promoted = prometheus_client.REGISTRY.get_sample_value(*promoted) or 0.0
    metrics.promoted([promotion], metrics.clock() - 0.003)
    metrics.started(Token("h1", 0), None)
    metrics.started(Token("h1", 0), None)  # a second start of the token (redelivery): not timed twice
    assert prometheus_client.REGISTRY.get_sample_value(count) == before + 1
    assert prometheus_client.REGISTRY.get_sample_value(*promoted) == before_promoted + 2
    bucket = prometheus_client.REGISTRY.get_sample_value("celery_keyed_handoff_seconds_bucket", {"le": "0.01"})
    assert bucket is not None and bucket >= 1


MULTIPROCESS = """
import os, sys, urllib.request
from types import SimpleNamespace
from celery_keyed import metrics
port, url = int(sys.argv[1]), sys.argv[2]
settings = SimpleNamespace(metrics_port=port, metrics_addr="127.0.0.1", metrics_timeout=2.0, database_url=url)
pid = os.fork()
if pid == 0:  # a pool process: the reconcile task repairs drift there
    metrics.drift_repaired(["a", "b"])
    os._exit(0)
os.waitpid(pid, 0)
metrics.admission("parked")  # the main process: the gate
assert metrics.serve(settings) is not None
print(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
"""


def test_multiprocess_mode_aggregates_the_pool_processes(database_url: str, ledger: Ledger, tmp_path: Path) -> None:
    """With PROMETHEUS_MULTIPROC_DIR, the worker's endpoint has the counters of its pool processes too."""
    fill(ledger)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", MULTIPROCESS, str(port), database_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(done.stdout)
        for s in family.samples
    }
    assert samples[("celery_keyed_reconcile_drift_repaired_total", ())] == 2  # counted in the child
    assert samples[("celery_keyed_admissions_total", (("outcome", "parked"),))] == 1
    assert samples[("celery_keyed_in_flight", (("name", "api"),))] == 4  # and the ledger gauges
