"""The pytest plugin (celery_keyed.contrib.pytest) used as a user would: its fixtures give a worker whose gate
really bounds keyed tasks (in-process thread worker and prefork subprocess workers), the control without the
gate shows the check would catch its absence, and the plugin is registered, documented and inert."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from importlib.metadata import entry_points
from typing import Any

import psycopg
import pytest
from celery import Celery

import celery_keyed
from celery_keyed import keyed_task
from celery_keyed.contrib.pytest import KeyedTimeline

pytest_plugins = ["pytester"]

#: Celery 5.7's Redis result backend calls redis-py 8's deprecated ``setex`` in the worker when it stores a
#: result: under the suite's ``filterwarnings = error`` no result would ever arrive (docs/testing.md says so).
SETEX_WARNING = "ignore:Call to deprecated setex:DeprecationWarning"
pytestmark = pytest.mark.filterwarnings(SETEX_WARNING)


def make_app(timeline: KeyedTimeline, *, install: bool = True, limits: dict[str, Any] | None = None) -> Any:
    app = Celery(f"plugin-test-{id(timeline)}", set_as_current=False)
    app.conf.keyed_concurrency_limits = limits or {}
    if install:
        celery_keyed.install(app)

    @keyed_task(app=app, concurrency_key="account:{account_id}")
    def sync(account_id: int) -> int:
        with timeline.running(f"account:{account_id}"):
            time.sleep(0.3)
        return account_id

    @keyed_task(app=app, concurrency_key="crm")
    def call_crm(n: int) -> int:
        with timeline.running("crm"):
            time.sleep(0.3)
        return n

    app.sync, app.call_crm = sync, call_crm
    return app


def test_the_plugin_is_registered_through_its_entry_point(request: pytest.FixtureRequest) -> None:
    found = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert found.get("celery_keyed") == "celery_keyed.contrib.pytest", (
        "the pytest11 entry point is missing from the installed metadata: reinstall (pip install -e .)"
    )
    plugin = request.config.pluginmanager.get_plugin("celery_keyed")
    assert plugin is not None and plugin.__name__ == "celery_keyed.contrib.pytest"


def test_in_process_worker_runs_the_gate_and_keeps_the_bounds(keyed_worker: Any, keyed_timeline: KeyedTimeline) -> None:
    from celery_keyed.gate import current_gate

    app = make_app(keyed_timeline, limits={"crm": 2})
    worker = keyed_worker(app, concurrency=6)
    gate = current_gate()
    assert gate is not None and gate.consumer is worker.consumer  # the KeyedGate bootstep of this worker

    results = [app.sync.delay(1) for _ in range(4)] + [app.sync.delay(2) for _ in range(2)]
    results += [app.call_crm.delay(n) for n in range(6)]
    assert [r.get(timeout=60) for r in results] == [1, 1, 1, 1, 2, 2, *range(6)]

    assert keyed_timeline.peak("account:1") == 1
    assert keyed_timeline.peak("account:2") == 1
    assert keyed_timeline.peak("crm") == 2  # a gate of 2 on 6 threads: exactly 2 at once, never 3
    assert keyed_timeline.count() == 12


def test_without_the_gate_the_same_check_fails(keyed_configure: Any, keyed_timeline: KeyedTimeline) -> None:
    """Control: the same tasks on a worker without the gate overlap, so the assertions above are not vacuous."""
    from celery.contrib.testing.worker import start_worker

    app = keyed_configure(make_app(keyed_timeline, install=False))
    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False, loglevel="WARNING"):
        results = [app.sync.delay(1) for _ in range(4)]
        assert [r.get(timeout=60) for r in results] == [1] * 4
    assert keyed_timeline.peak("account:1") > 1


def test_keyed_worker_refuses_an_app_without_the_gate(keyed_worker: Any, keyed_timeline: KeyedTimeline) -> None:
    with pytest.raises(pytest.UsageError, match=r"install\(app\)"):
        keyed_worker(make_app(keyed_timeline, install=False))


def test_one_in_process_worker_at_a_time(keyed_worker: Any, keyed_timeline: KeyedTimeline) -> None:
    app = make_app(keyed_timeline)
    keyed_worker(app)
    with pytest.raises(pytest.UsageError, match="keyed_worker_process"):
        keyed_worker(app)


def test_keyed_configure_points_the_app_at_the_test_servers(
    keyed_configure: Any, keyed_ledger_url: str, keyed_broker_url: str
) -> None:
    app = Celery("configured", set_as_current=False)
    assert keyed_configure(app) is app
    assert app.conf.keyed_database_url == keyed_ledger_url
    assert app.conf.broker_url == keyed_broker_url == app.conf.result_backend
    with psycopg.connect(keyed_ledger_url.replace("+psycopg", "")) as conn:  # the ledger's schema is there
        assert conn.execute("SELECT count(*) FROM keyed_migrations").fetchone()[0] > 0  # type: ignore[index]


@pytest.fixture
def observed(keyed_ledger_url: str) -> Iterator[psycopg.Connection[Any]]:
    from plugin_proj import OBSERVED, dsn

    with psycopg.connect(dsn(keyed_ledger_url), autocommit=True) as conn:
        conn.execute(OBSERVED)
        yield conn


def peak_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def test_prefork_worker_processes_keep_the_bound(
    keyed_worker_process: Any, keyed_configure: Any, observed: psycopg.Connection[Any]
) -> None:
    from plugin_proj import app, sync

    keyed_configure(app)  # this process publishes to the workers' broker and ledger
    w1 = keyed_worker_process("plugin_proj:app", concurrency=3)
    w2 = keyed_worker_process("plugin_proj:app", concurrency=3)
    results = [sync.delay(1) for _ in range(5)] + [sync.delay(2) for _ in range(3)]
    pids = {r.get(timeout=90) for r in results}
    assert len(pids) > 1  # pool processes (of one or both workers) shared the work

    rows = observed.execute(
        """SELECT s.key, extract(epoch FROM s.at)::float8, extract(epoch FROM e.at)::float8
             FROM observed s JOIN observed e ON e.task_id = s.task_id AND e.kind = 'end' WHERE s.kind = 'start'"""
    ).fetchall()
    assert len(rows) == 8
    for key in ("account:1", "account:2"):
        assert peak_overlap([(s, e) for k, s, e in rows if k == key]) == 1, rows
    assert peak_overlap([(s, e) for _, s, e in rows]) == 2  # the two accounts side by side
    assert w1.proc.poll() is None
    w2.stop()
    assert w2.proc.returncode == 0, w2.output()[-3000:]


def test_timeline_counts_runs_at_once() -> None:
    timeline = KeyedTimeline()
    barrier = threading.Barrier(3)

    def run(key: str) -> None:
        with timeline.running(key):
            barrier.wait(timeout=10)

    threads = [threading.Thread(target=run, args=(k,)) for k in ("a", "a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (timeline.peak("a"), timeline.peak("b"), timeline.peak(), timeline.peak("c")) == (2, 1, 3, 0)
    assert timeline.count("a") == 2 and timeline.in_progress() == 0


INERT = """
import celery_keyed.contrib.pytest as plugin
from celery_keyed import testing as testbed

def test_plain(request):
    assert request.config.pluginmanager.get_plugin("celery_keyed") is plugin
    assert not testbed.live_servers()  # no server started for a test that asks for none of the fixtures

def test_fixture_free_too():
    assert not testbed.live_servers()
"""


def test_the_plugin_is_inert_and_documented(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makepyfile(test_inert=INERT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    listing = pytester.runpytest_subprocess("--fixtures", "-p", "no:cacheprovider")
    text = listing.stdout.str()
    for name in (
        "keyed_postgres_server",
        "keyed_redis_server",
        "keyed_ledger_url",
        "keyed_broker_url",
        "keyed_app_config",
        "keyed_configure",
        "keyed_worker",
        "keyed_worker_process",
        "keyed_timeline",
    ):
        assert f"\n{name}" in text, name
    section = text.split("fixtures defined from celery_keyed.contrib.pytest")[1].split("fixtures defined from")[0]
    assert "no docstring available" not in section, section


RESTORED = """
from celery import Celery
import celery_keyed

app = Celery("restored", set_as_current=False)
app.conf.broker_url = "redis://example.invalid:6379/0"
app.conf.keyed_database_url = "postgresql+psycopg://example.invalid/proj"
celery_keyed.install(app)

def test_a_configures(keyed_configure, keyed_ledger_url):
    keyed_configure(app)
    assert app.conf.keyed_database_url == keyed_ledger_url

def test_b_settings_come_back():
    assert app.conf.broker_url == "redis://example.invalid:6379/0"
    assert app.conf.keyed_database_url == "postgresql+psycopg://example.invalid/proj"
    assert getattr(app, "_keyed_publisher", None) is None
"""


def test_keyed_configure_restores_the_settings(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makepyfile(test_restored=RESTORED)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)



RUNNING_AT_TEARDOWN = """
import gc
import time

import psycopg
import pytest
import sqlalchemy as sa
from celery import Celery

import celery_keyed
from celery_keyed import keyed_task

app = Celery("teardown", set_as_current=False)
celery_keyed.install(app)


@keyed_task(app=app, concurrency_key="account:{account_id}")
def slow(account_id):
    time.sleep(1.5)
    return account_id


@pytest.fixture
def after_the_worker(keyed_ledger_url):
    yield  # torn down after keyed_worker (set up before it), before the test's database is dropped
    engine = sa.create_engine(keyed_ledger_url)
    with engine.connect() as conn:
        claims = conn.execute(sa.text("SELECT task_id, state FROM keyed_claims")).all()
    engine.dispose()
    assert claims == []  # both tasks ended and were released before the gate closed its connections
    gc.collect()
    open_connections = [c for c in gc.get_objects() if isinstance(c, psycopg.Connection) and not c.closed]
    assert open_connections == []


def test_tasks_still_running_when_the_test_returns(after_the_worker, keyed_worker):
    keyed_worker(app, concurrency=2)
    slow.delay(1)
    slow.delay(2)
    time.sleep(0.5)  # both run; the worker stops while they do
"""


def test_keyed_worker_releases_running_tasks_then_closes_its_connections(pytester: pytest.Pytester) -> None:
    """The fixture closes the gate after the worker stopped and its running tasks were released, not before:
    closed earlier, a release on its way checks out a connection of the disposed engine that nobody closes (a
    ResourceWarning at garbage collection, an error under ``filterwarnings = error``: it failed the docs example
    once in CI), and a task left running keeps its slot."""
    pytester.makeini(f"[pytest]\nfilterwarnings =\n    error\n    {SETEX_WARNING}\n")
    pytester.makepyfile(test_teardown=RUNNING_AT_TEARDOWN)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
