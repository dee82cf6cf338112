"""``celery keyed`` on a real ledger: click's runner against a real app object for most commands, and the real
``celery`` command in a subprocess to prove the entry point. JSON output is checked field by field; writes
are checked in the ledger's own tables (overrides, their audit rows, counters)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_keyed.cli import keyed, render_table
from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict
from celery_keyed.publisher import close_publisher
from celery_keyed.task import HEADER_NONCE

ROOT = Path(__file__).resolve().parents[2]
MESSAGE = {
    "task": "proj.t", "body": "W1tdLCB7fSwge31d", "content_type": "application/json",
    "content_encoding": "utf-8", "headers": {"task": "proj.t"}, "properties": {},
    "exchange": "", "routing_key": "celery",
}  # fmt: skip


@pytest.fixture
def app(database_url: str, redis_url: str) -> Iterator[Celery]:
    app = Celery("cli-test", broker=redis_url, set_as_current=False)
    app.conf.keyed_database_url = database_url
    app.conf.keyed_concurrency_limits = {"api": 3}
    yield app
    close_publisher(app)
    app.close()


def run(app: Celery, *args: str, code: int = 0) -> Result:
    result = CliRunner().invoke(keyed, list(args), obj=CLIContext(app=app, no_color=True, workdir=None))
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    return result


def run_json(app: Celery, *args: str) -> Any:
    return json.loads(run(app, *args, "--json").stdout)


def park(ledger: Ledger, task_id: str, key: str) -> Verdict:
    message = {**MESSAGE, "headers": {**MESSAGE["headers"], "id": task_id}}
    return ledger.admit(Arrival(task_id, key=key, task_name="proj.t", message=message)).verdict


@pytest.fixture
def busy(ledger: Ledger) -> Ledger:
    """api (configured 3): api:t1 with 3 running + 2 parked, api:t2 with 1 running; account (unconfigured, a
    mutex): account:7 with 1 running + 1 parked; stripe: overridden to 0 (paused), no keys."""
    ledger.configure({"api": NameConfig("api", limit=3)})
    verdicts = [park(ledger, f"a{i}", "api:t1") for i in range(5)]
    assert verdicts == [Verdict.ADMITTED] * 3 + [Verdict.PARKED] * 2
    assert park(ledger, "b0", "api:t2") is Verdict.ADMITTED
    assert [park(ledger, f"c{i}", "account:7") for i in range(2)] == [Verdict.ADMITTED, Verdict.PARKED]
    ledger.set_override("stripe", 0, reason="incident 42", author="alice")
    return ledger


def test_status_json_names_and_keys(app: Celery, busy: Ledger) -> None:
    doc = run_json(app, "status")
    names = {n["name"]: n for n in doc["names"]}
    assert set(names) == {"account", "api", "stripe"}
    api, account, stripe = names["api"], names["account"], names["stripe"]
    assert (api["limit"], api["source"], api["keys"], api["in_flight"], api["waiting"]) == (3, "config", 2, 4, 2)
    assert (account["limit"], account["source"], account["in_flight"], account["waiting"]) == (1, "default", 1, 1)
    assert (stripe["limit"], stripe["source"], stripe["paused"], stripe["keys"]) == (0, "override", True, 0)
    assert (stripe["override_reason"], stripe["override_author"]) == ("incident 42", "alice")
    assert 0 <= api["oldest_waiting_age"] < 60 and stripe["oldest_waiting_age"] is None
    assert [k["key"] for k in doc["keys"]] == ["api:t1", "account:7", "api:t2"]  # most waiting, then in flight
    t1 = doc["keys"][0]
    assert (t1["limit"], t1["source"], t1["in_flight"], t1["waiting"]) == (3, "config", 3, 2)
    assert t1["oldest_waiting_age"] >= 0 and doc["keys"][2]["oldest_waiting_age"] is None
    assert doc["keys_total"] == 3
    assert doc["notes"] == []  # the ledger holds what this app configures


def test_status_notes_a_configuration_the_workers_have_not_stored(app: Celery, ledger: Ledger) -> None:
    app.conf.keyed_concurrency_limits = {"api": 3, "mail": 10}
    ledger.configure({"api": NameConfig("api", limit=2)})  # what the running workers started with
    doc = run_json(app, "status")
    assert doc["notes"] == [
        "api: this app configures limit 3, the ledger has 2: workers store the configuration when they start",
        "mail: this app configures limit 10, the ledger has no configuration (default 1): workers store the "
        "configuration when they start",
    ]
    assert "note: api: this app configures limit 3" in run(app, "status").stderr


def test_status_filters_and_row_limit(app: Celery, busy: Ledger) -> None:
    doc = run_json(app, "status", "--name", "api", "--limit", "1")
    assert [n["name"] for n in doc["names"]] == ["api"]
    assert [k["key"] for k in doc["keys"]] == ["api:t1"] and doc["keys_total"] == 2
    assert run_json(app, "status", "--limit", "0")["keys"] == []
    done = busy.admit(Arrival("d0", key="api:idle"))
    busy.release(Token("d0", 0), done.fence, Outcome.COMPLETED)  # a key with nothing held or parked
    assert "api:idle" not in [k["key"] for k in run_json(app, "status")["keys"]]
    everything = run_json(app, "status", "--all")
    assert [k["key"] for k in everything["keys"]][-1] == "api:idle" and everything["keys_total"] == 4


def test_status_human_table(app: Celery, busy: Ledger) -> None:
    out = run(app, "status").stdout
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "LIMIT", "SOURCE", "RULES", "KEYS", "IN", "FLIGHT", "WAITING", "OLDEST", "WAIT",
                                "OVERRIDE"]
    stripe = next(line for line in lines if line.startswith("stripe"))
    assert "PAUSED by alice" in stripe and "incident 42" in stripe
    assert any(line.split()[:5] == ["api:t1", "3", "config", "3", "2"] for line in lines)
    assert "(3 of 3 busy keys shown; 3 keys in the ledger)" in out


def test_set_limit_writes_override_with_audit_and_promotes(
    app: Celery, busy: Ledger, engine: sa.Engine, redis_url: str
) -> None:
    doc = run_json(app, "set-limit", "api", "5", "--reason", "more capacity", "--author", "bob", "--expires-in", "600")
    assert (doc["limit"], doc["previous_limit"], doc["previous_source"], doc["promoted"]) == (5, 3, "config", 2)
    with engine.connect() as conn:
        override = conn.execute(sa.text("SELECT * FROM keyed_overrides WHERE name = 'api'")).mappings().one()
        log = conn.execute(sa.text("SELECT * FROM keyed_override_log WHERE name = 'api'")).mappings().all()
        promoted = conn.execute(sa.text("SELECT count(*) FROM keyed_claims WHERE state = 'promoted'")).scalar()
    assert (override["slot_limit"], override["reason"], override["author"]) == (5, "more capacity", "bob")
    expected_expiry = datetime.now(UTC) + timedelta(seconds=600)
    assert abs((override["expires_at"] - expected_expiry).total_seconds()) < 30
    assert [(r["action"], r["old_limit"], r["new_limit"], r["reason"], r["author"]) for r in log] == [
        ("set", None, 5, "more capacity", "bob")
    ]
    assert promoted == 2  # both parked api:t1 attempts were given a slot and published with their nonce
    client = redis.Redis.from_url(redis_url)
    published = [json.loads(client.lpop("celery")) for _ in range(client.llen("celery"))]
    assert sorted(m["headers"]["id"] for m in published) == ["a3", "a4"]
    assert all(m["headers"][HEADER_NONCE] for m in published)

    doc = run_json(app, "clear-limit", "api", "--reason", "back to normal", "--author", "bob")
    assert (doc["cleared"], doc["previous_limit"], doc["limit"], doc["source"]) == (True, 5, 3, "config")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM keyed_overrides WHERE name = 'api'")).scalar() == 0
        last = conn.execute(sa.text("SELECT * FROM keyed_override_log ORDER BY id DESC LIMIT 1")).mappings().one()
    assert (last["name"], last["action"], last["old_limit"], last["reason"]) == ("api", "clear", 5, "back to normal")
    again = run_json(app, "clear-limit", "api")
    assert again["cleared"] is False  # nothing to clear: no audit row either
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM keyed_override_log WHERE name = 'api'")).scalar() == 2


def test_set_limit_pause_until_and_human_output(app: Celery, ledger: Ledger, engine: sa.Engine) -> None:
    out = run(app, "set-limit", "api", "0", "--reason", "maintenance", "--until", "2999-01-01T10:00:00").stdout
    assert out.startswith("api: paused until 2999-01-01 10:00:00Z, was 1 (default)")  # no worker synced api yet
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT slot_limit, expires_at, author FROM keyed_overrides")).one()
    assert row.slot_limit == 0 and row.expires_at == datetime(2999, 1, 1, 10, tzinfo=UTC)
    assert row.author.endswith("(celery keyed)")  # user@host by default
    assert "override 0 cleared; limit 1 (default)" in run(app, "clear-limit", "api").stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["set-limit", "api", "-1", "--reason", "x"], "-1 is not in the range 0<=x<=1073741823"),
        # issue 9: past the ledger's integer column, once a raw database error with a traceback (exit 1)
        (["set-limit", "api", str(10**12), "--reason", "x"], "1000000000000 is not in the range 0<=x<=1073741823"),
        (["set-limit", "api", str(2**63), "--reason", "x"], "9223372036854775808 is not in the range 0<=x<=1073741823"),
        (["set-limit", "api", "2", "--reason", "x", "--expires-in", "1e300"], "is not in the range 0<x<=3155760000"),
        (["set-limit", "api", "2", "--reason", "x", "--expires-in", "inf"], "is not in the range 0<x<=3155760000"),
        (["set-limit", "api", "2", "--reason", "x", "--expires-in", "nan"], "'nan' is not a finite number of seconds"),
        (["set-limit", "api", "2", "--reason", "x", "--until", "9999-12-31T23:59:59-01:00"], "past the year 9999"),
        (["status", "--limit", str(10**30)], "is not in the range 0<=x<=2147483647"),
        (["status", "--timeout", "1e300"], "is not in the range 0<x<=2147483.647"),
        (["status", "--timeout", "nan"], "is not a finite number of seconds"),
        (["set-limit", "api", "two", "--reason", "x"], "'two' is not a valid integer"),
        (["set-limit", "api", "2"], "Missing option '--reason'"),
        (["set-limit", "api", "2", "--reason", "   "], "a reason is required"),
        (["set-limit", "bad name", "2", "--reason", "x"], "a name must be"),
        (["set-limit", "api:t1", "2", "--reason", "x"], "a name must be"),
        (["set-limit", "api", "2", "--reason", "x", "--expires-in", "0"], "0.0 is not in the range 0<x<=3155760000"),
        (["set-limit", "api", "2", "--reason", "x", "--until", "yesterday"], "not an ISO 8601 time"),
        (["set-limit", "api", "2", "--reason", "x", "--until", "2001-01-01"], "in the past"),
        (["set-limit", "api", "2", "--reason", "x", "--until", "2999-01-01", "--expires-in", "5"], "not both"),
        (["clear-limit", "bad name"], "a name must be"),
        (["status", "--name", "x y"], "a name must be"),
        (["status", "--limit", "-3"], "-3 is not in the range 0<=x<=2147483647"),
    ],
)
def test_bad_input_is_a_click_error_and_changes_nothing(
    app: Celery, ledger: Ledger, engine: sa.Engine, args: list[str], message: str
) -> None:
    ledger.set_override("api", 2, reason="before", author="alice")
    result = run(app, *args, code=2)
    assert message in result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output  # one line, no traceback
    with engine.connect() as conn:
        overrides = conn.execute(sa.text("SELECT name, slot_limit, reason FROM keyed_overrides")).all()
        log = conn.execute(sa.text("SELECT count(*) FROM keyed_override_log")).scalar()
    assert [tuple(r) for r in overrides] == [("api", 2, "before")] and log == 1


def test_explain(app: Celery, busy: Ledger) -> None:
    running = run_json(app, "explain", "a0")
    assert running["state"] == "running" and running["facts"]["key"] == "api:t1" and running["facts"]["fence"] >= 1
    waiting = run_json(app, "explain", "a4")
    assert waiting["state"] == "waiting" and waiting["facts"]["ahead"] == 1
    assert "waiting behind 1 others for key api:t1 (in flight 3/3)" in waiting["text"]
    assert json.loads(run(app, "explain", "nope", "--json", code=1).stdout)["state"] == "unknown"  # exits 1
    out = run(app, "explain", "c1").stdout
    assert out.splitlines()[0] == "c1: waiting" and "next in line for account:7 (1 of 1 slot in use)" in out


def test_explain_says_it_in_sentences(app: Celery, busy: Ledger) -> None:
    """The human output is sentences built from the facts (which worker, since when, slots in use, tasks ahead),
    never a dump of fact names and values such as ``k: 3`` or ``shadow: False``."""
    running = run(app, "explain", "a0").stdout.splitlines()
    assert running[0] == "a0: running"
    assert re.fullmatch(
        r"  running on worker [^ ]+ \(pid \d+\) since \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ"
        r" \(3 of 3 slots of api:t1 in use\)",
        running[1],
    ), running
    assert "s more and the worker renews it while it runs" in running[2]
    waiting = run(app, "explain", "a4").stdout
    assert "  waiting behind 1 task of api:t1 (3 of 3 slots in use)\n" in waiting
    assert "  it arrived at " in waiting
    for out in (running, waiting.splitlines()):
        assert not any(re.match(r"  [a-z_]+: ", line) for line in out), out  # no "fact: value" lines
    run(app, "set-limit", "api", "4", "--reason", "more room")  # promotes a3 (published, not started by a worker)
    promoted = run(app, "explain", "a3").stdout
    assert "  given a slot at " in promoted and "(4 of 4 slots of api:t1 in use) and on its way to a worker" in promoted
    assert "it goes back in line" in promoted
    unknown = run(app, "explain", "nope", code=1).stdout
    assert unknown.splitlines()[0] == "nope: unknown" and "no record of this task id" in unknown


def test_reconcile_reports_and_repairs_drift(app: Celery, busy: Ledger, engine: sa.Engine) -> None:
    with engine.begin() as conn:  # a counter that disagrees with the claims that exist (a bug, simulated)
        conn.execute(sa.text("UPDATE keyed_slots SET used = 3 WHERE key = 'api:t2'"))
    doc = run_json(app, "reconcile")
    assert doc["drift"] == ["api:t2 shard 0: used 3 but 1 claims exist"]
    assert doc["reclaimed"] == "skipped (use --reclaim)"
    assert doc["pruned"] == 0  # nothing finished before keyed_books_retention (7 days)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT used FROM keyed_slots WHERE key = 'api:t2'")).scalar() == 1
    out = run(app, "reconcile", "--reclaim").stdout
    assert "no drift" in out and out.splitlines()[1].split() == ["reclaimed", "0"]


def test_migrate_and_a_ledger_without_schema(blank_database_url: str, redis_url: str) -> None:
    app = Celery("cli-test", broker=redis_url, set_as_current=False)
    app.conf.keyed_database_url = blank_database_url
    try:
        result = run(app, "status", code=1)
        assert "has no schema: run `celery -A <app> keyed migrate`" in result.output
        first = run_json(app, "migrate")
        assert first["applied"] and first["applied"] == first["versions"]
        assert run_json(app, "migrate")["applied"] == []
        assert "the ledger is up to date" in run(app, "migrate").stdout
        assert run_json(app, "status")["names"] == []
    finally:
        close_publisher(app)
        app.close()


def test_unreachable_ledger_and_missing_url_are_clear_errors(redis_url: str) -> None:
    app = Celery("cli-test", broker=redis_url, set_as_current=False)
    app.conf.keyed_database_url = "postgresql+psycopg://nobody:secret@127.0.0.1:1/none"
    app.conf.keyed_connect_timeout = 1.0
    result = run(app, "status", code=1)
    assert "cannot reach the ledger at postgresql+psycopg://nobody:***@127.0.0.1:1/none" in result.output
    assert "secret" not in result.output
    bare = Celery("cli-test", broker=redis_url, set_as_current=False)
    bare.conf.keyed_database_url = None
    if "KEYED_DATABASE_URL" not in os.environ:
        assert "keyed_database_url" in run(bare, "status", code=1).output


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sqlite:///ledger.db", "keyed_database_url must be a PostgreSQL URL"),
        ("mysql://user:secret@db/app", "got a 'mysql' URL (mysql://user:***@db/app)"),
    ],
)
@pytest.mark.parametrize("command", [["status"], ["migrate"], ["set-limit", "api", "2", "--reason", "x"]])
def test_a_ledger_url_that_is_not_postgresql_is_a_clear_error(
    redis_url: str, url: str, message: str, command: list[str]
) -> None:
    """Issue 9: once ModuleNotFoundError (mysql) or a raw SQLAlchemy error with a traceback."""
    app = Celery("cli-test", broker=redis_url, set_as_current=False)
    app.conf.keyed_database_url = url
    result = run(app, *command, code=1)
    assert message in result.output and "secret" not in result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output


def test_a_ledger_behind_this_version_says_to_migrate(
    blank_database_url: str, redis_url: str, ledger_of_an_older_release: Callable[[sa.Engine], list[str]]
) -> None:
    engine = sa.create_engine(blank_database_url)
    ledger_of_an_older_release(engine)  # as an older release would have left it
    engine.dispose()
    app = Celery("cli-test", broker=redis_url, set_as_current=False)
    app.conf.keyed_database_url = blank_database_url
    try:
        result = run(app, "reconcile", code=1)
        assert "the ledger's schema is behind this version of celery-keyed (pending: " in result.output
        assert "run `celery -A <app> keyed migrate`" in result.output
        run(app, "migrate")
        assert run_json(app, "reconcile")["drift"] == []
    finally:
        close_publisher(app)
        app.close()


def test_render_table_aligns_columns() -> None:
    assert render_table(("A", "NUM"), [("x", 1), ("long", 100)], right=(1,)).splitlines() == [
        "A     NUM",
        "x       1",
        "long  100",
    ]


def test_the_celery_command_runs_the_plugin(database_url: str, ledger: Ledger, engine: sa.Engine) -> None:
    """The real ``celery`` program finds ``keyed`` through the ``celery.commands`` entry point."""
    park(ledger, "a0", "api:t1")
    env = {
        **os.environ,
        "KEYED_DATABASE_URL": database_url,
        "KEYED_LIMITS": json.dumps({"api": 2}),
        "CELERY_BROKER_URL": "memory://",
        "PYTHONPATH": str(ROOT),
        "PYTHONWARNINGS": "ignore",
    }
    celery = [sys.executable, "-m", "celery", "-A", "tests.integration.cli_app", "keyed"]
    done = subprocess.run(
        [*celery, "set-limit", "api", "0", "--reason", "from a shell", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["paused"] is True
    done = subprocess.run([*celery, "status", "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert [(n["name"], n["limit"], n["source"], n["in_flight"]) for n in doc["names"]] == [("api", 0, "override", 1)]
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT reason FROM keyed_override_log")).scalar() == "from a shell"
    bad = subprocess.run([*celery, "set-limit", "api", "-5", "--reason", "x"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "-5 is not in the range 0<=x<=1073741823" in bad.stderr


def test_status_shows_rate_fair_and_uncertain_rules(app: Celery, ledger: Ledger) -> None:
    ledger.configure(
        {
            "api": NameConfig("api", limit=10, rate="100/m", burst=10, fair=True),
            "bank": NameConfig("bank", limit=1, uncertain_hold=30.0),
            "quota": NameConfig("quota", limit=2, windows=["100/m", "10000/d", "5/10s"]),
            "tenant": NameConfig("tenant", limit=2, cap=20, borrow=True),
        }
    )
    lines = run(app, "status").stdout.splitlines()
    api = next(line for line in lines if line.startswith("api "))
    bank = next(line for line in lines if line.startswith("bank "))
    assert "rate 100/m burst 10, fair" in api
    assert "uncertain 30s" in bank
    assert "windows 5/10s 100/m 10000/d" in next(line for line in lines if line.startswith("quota "))
    assert "cap 20 borrow" in next(line for line in lines if line.startswith("tenant "))
    assert (
        "tenant: its keys together run at most 20; a key may run up to 20 while no task waits for that room."
    ) in lines
    assert (
        "quota: each key starts at most 5 in any 10 seconds, 100 in any minute and 10000 in any day."
    ) in lines
    doc = run_json(app, "status")
    by_name = {n["name"]: n for n in doc["names"]}
    assert by_name["api"]["fair"] is True and abs(by_name["api"]["rate"] - 100 / 60) < 1e-9
    assert by_name["quota"]["windows"] == [[5, 10.0], [100, 60.0], [10000, 86400.0]]


def test_status_shows_the_rules_that_reject_or_expire_tasks(app: Celery, ledger: Ledger) -> None:
    """max_waiting (and what a full room does), max_wait, shards and rate: in the RULES column as the settings name
    them, and one sentence per name saying what happens to a task; in the JSON too."""
    ledger.configure(
        {
            "api": NameConfig("api", limit=4, shards=2, max_waiting=100, max_wait=30.0, rate="6/s", burst=3),
            "mail": NameConfig("mail", limit=1, max_waiting=1, overflow="supersede"),
            "plain": NameConfig("plain", limit=2),
        }
    )
    out = run(app, "status").stdout
    lines = out.splitlines()
    api = next(line for line in lines if line.startswith("api "))
    assert "max_waiting 100, max_wait 30s, shards 2, rate 6/s burst 3" in api
    assert "max_waiting 1 supersede" in next(line for line in lines if line.startswith("mail "))
    assert next(line for line in lines if line.startswith("plain ")).split()[3] == "-"
    assert (
        "api: once 100 tasks of a key wait, a new arrival is rejected; a task that has not started 30s after it"
        " arrived expires; each key starts at most 6/s (saving up at most 3); each key's limit is spread over 2 shards."
    ) in lines
    assert "mail: once 1 task of a key waits, a new arrival replaces the oldest waiting task." in lines
    assert not any(line.startswith("plain:") for line in lines)
    by_name = {n["name"]: n for n in run_json(app, "status")["names"]}
    api_doc = by_name["api"]
    assert (api_doc["max_waiting"], api_doc["max_wait"], api_doc["shards"], api_doc["overflow"]) == (
        100, 30.0, 2, "reject"
    )
    mail, plain = by_name["mail"], by_name["plain"]
    assert (mail["overflow"], plain["max_waiting"], plain["shards"]) == ("supersede", None, 1)
