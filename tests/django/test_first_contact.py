"""A new Django user's first contact (issue 10, defect 5): SQLite fails a system check before ``migrate`` touches
anything; the ledger's database is named once (``CELERY_KEYED_DATABASE``); the admin's actions show up in Django's
own History / Recent actions; the explain page names who holds the slot a task waits for, in words; the lists of
waiting tasks and claims show the task's name and arguments; the live pages refresh; messages say the name as it is
and count right."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery_keyed_django.admin import _promotions_text
from celery_keyed_django.checks import ledger_database_is_postgresql
from django.contrib.admin.models import ADDITION, CHANGE, DELETION, LogEntry
from django.test import Client

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Verdict
from celery_keyed.settings import django_database_url, read_settings
from tests.django.test_admin import messages_of, post_override, scalar, url

ROOT = Path(__file__).resolve().parents[2]


def arrival(task_id: str, key: str = "acct:1", args: str = "(7,)", kwargs: str = "{'mode': 'full'}") -> Arrival:
    message = {"task": "proj.sync", "headers": {"argsrepr": args, "kwargsrepr": kwargs}}
    return Arrival(task_id, key=key, task_name="proj.sync", queue="celery", message=message)


@pytest.fixture
def ledger(ledger_engine: sa.Engine) -> Ledger:
    ledger = Ledger(ledger_engine, holder="worker-1:4242:beef", lease=60.0)
    ledger.configure({"acct": NameConfig("acct", 1)})
    return ledger


# -- SQLite: a system check, before migrate runs ------------------------------------------------------------------


SQLITE_SETTINGS = """
SECRET_KEY = "x"
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "celery_keyed_django"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": %r}}
"""


def test_migrate_on_sqlite_fails_a_system_check_first(tmp_path: Path) -> None:
    (tmp_path / "sqlite_settings.py").write_text(SQLITE_SETTINGS % str(tmp_path / "db.sqlite3"))
    result = subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--settings", "sqlite_settings"],
        cwd=tmp_path, env={"PYTHONPATH": f"{tmp_path}:{ROOT}:{ROOT / 'django_app'}", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert "celery_keyed_django.E002" in result.stderr and "needs PostgreSQL" in result.stderr
    assert "Traceback" not in result.stderr  # a system check, not a crash in the middle of migrate
    assert not (tmp_path / "db.sqlite3").exists() or (tmp_path / "db.sqlite3").stat().st_size == 0  # nothing ran


def test_the_check_passes_on_postgresql_and_names_a_missing_alias(settings: Any) -> None:
    assert ledger_database_is_postgresql() == []
    settings.CELERY_KEYED_DATABASE = "ledger"
    assert [e.id for e in ledger_database_is_postgresql()] == ["celery_keyed_django.E001"]


# -- CELERY_KEYED_DATABASE: the ledger named by a Django database alias ---------------------------------------------


@pytest.mark.django_db
def test_the_workers_read_the_ledger_url_from_a_django_alias(settings: Any, ledger_engine: sa.Engine) -> None:
    settings.CELERY_KEYED_DATABASE = "default"
    url = read_settings({"keyed_database": "default"}).database_url  # what CELERY_KEYED_DATABASE becomes in Celery
    assert url == django_database_url("default")
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:  # the same database as Django's (the test database)
            assert conn.execute(sa.text("SELECT current_database()")).scalar() == scalar(
                ledger_engine, "SELECT current_database()")
    finally:
        engine.dispose()
    # an explicit URL still wins; a non-PostgreSQL alias is a clear error
    assert read_settings({"keyed_database": "default", "keyed_database_url": "postgresql://h/x"}).database_url == (
        "postgresql+psycopg://h/x")
    from celery_keyed.ledger.errors import InvalidConfig

    with pytest.raises(InvalidConfig, match="needs PostgreSQL"):
        django_database_url("lite", {"lite": {"ENGINE": "django.db.backends.sqlite3", "NAME": "x"}})
    with pytest.raises(InvalidConfig, match="not an alias"):
        django_database_url("nope", {"default": {}})


def test_password_and_options_make_it_into_the_url() -> None:
    url = django_database_url("db", {"db": {"ENGINE": "django.db.backends.postgresql", "NAME": "app", "USER": "u",
                                            "PASSWORD": "p@ss", "HOST": "db.local", "PORT": "6543",
                                            "OPTIONS": {"sslmode": "require"}}})
    parsed = sa.engine.make_url(url)
    assert (parsed.drivername, parsed.username, parsed.password, parsed.host, parsed.port, parsed.database) == (
        "postgresql+psycopg", "u", "p@ss", "db.local", 6543, "app")
    assert parsed.query == {"sslmode": "require"}


# -- Django's admin log ---------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_admin_actions_are_in_djangos_admin_log(admin_client: Client, ledger: Ledger,
                                                ledger_engine: sa.Engine) -> None:
    post_override(admin_client, "acct", 0, "INC-1 paused")
    admin_client.post(url("override_clear", "acct"), {"reason": "INC-1 over"}, follow=True)
    running = ledger.admit(arrival("t-run"))
    ledger.admit(arrival("t-wait"))
    ledger.admit(arrival("t-wait-2"))
    arrival_no = scalar(ledger_engine, "SELECT arrival FROM keyed_waiting WHERE task_id = 't-wait-2'")
    admin_client.post(url("waiting_changelist"), {"action": "cancel_action", "_selected_action": [arrival_no],
                                                   "post": "yes", "reason": "duplicate job"})
    admin_client.post(url("claim_changelist"), {"action": "force_release_action", "_selected_action": [running.fence],
                                                 "post": "yes", "reason": "hung"})
    entries = [(e.content_type.model, e.object_id, e.action_flag, e.change_message)
               for e in LogEntry.objects.order_by("action_time", "id")]
    assert entries == [
        ("override", "acct", ADDITION, "Limit set to 0 (paused): INC-1 paused"),
        ("override", "acct", DELETION, "Override cleared: INC-1 over"),
        ("waiting", str(arrival_no), CHANGE, "Cancelled (revoked): duplicate job"),
        ("claim", str(running.fence), CHANGE, "Force-released: hung"),
    ]
    index = admin_client.get("/admin/").content.decode()
    assert "Recent actions" in index and "acct" in index  # the index page's "Recent actions" lists them


# -- explain, lists, refresh ----------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_explain_names_who_holds_the_slot_in_words(admin_client: Client, ledger: Ledger) -> None:
    assert ledger.admit(arrival("t-run")).verdict is Verdict.ADMITTED
    assert ledger.admit(arrival("t-wait")).verdict is Verdict.PARKED
    body = admin_client.get(url("explain"), {"task_id": "t-wait"}).content.decode()
    assert "Holding the slots it waits for" in body
    holders = body[body.index('id="keyed-holders"'):]
    assert "t-run" in holders and "proj.sync" in holders and "worker-1:4242:beef" in holders
    assert "Limit of the key (slots)" in body and "Tasks in flight under the key" in body
    assert ">K<" not in body and ">Shadow<" not in body
    body = admin_client.get(url("explain"), {"task_id": "t-run"}).content.decode()
    assert "Lease left" in body
    lease = re.search(r"Lease left</td><td>([^<]*)</td>", body)
    assert lease is not None and re.fullmatch(r"\d+s|1m 00s", lease.group(1)), body  # "59s", not "58.801643"


@pytest.mark.django_db
def test_waiting_and_claims_lists_show_task_name_and_arguments(admin_client: Client, ledger: Ledger) -> None:
    ledger.admit(arrival("t-run"))
    ledger.admit(arrival("t-wait", args="(8,)"))
    # In the task's own cell (the lists fit a laptop's window): its id, then its name, then its arguments.
    waiting = admin_client.get(url("waiting_changelist")).content.decode()
    cell = re.search(r"t-wait</code></a><br><span class=\"keyed-sub\">([^<]*)</span><br>"
                     r"<span class=\"keyed-sub keyed-quiet\">([^<]*)</span>", waiting)
    assert cell is not None, waiting
    assert cell[1] == "proj.sync" and cell[2] == "(8,), {&#x27;mode&#x27;: &#x27;full&#x27;}"
    claims = admin_client.get(url("claim_changelist")).content.decode()
    assert re.search(r"t-run</code></a><br><span class=\"keyed-sub\">proj.sync</span>", claims), claims


@pytest.mark.django_db
def test_live_pages_refresh_themselves(admin_client: Client) -> None:
    for page in ("key_changelist", "claim_changelist", "waiting_changelist"):
        body = admin_client.get(url(page)).content.decode()
        assert 'id="keyed-auto-refresh"' in body and "window.location.reload()" in body, page
    assert "keyed-auto-refresh" not in admin_client.get(url("override_changelist")).content.decode()


# -- messages ---------------------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_messages_keep_the_name_and_count_right(admin_client: Client, ledger: Ledger) -> None:
    response = post_override(admin_client, "stripe", 0, "INC-2")
    assert any(m.startswith("Name “stripe” is now paused") for m in messages_of(response))
    assert _promotions_text([object()], 1) == "1 waiting task got a slot at once and was sent to the workers."
    two = _promotions_text([object(), object()], 2)
    assert two == "2 waiting tasks got a slot at once and were sent to the workers."
    assert "starts it within" in _promotions_text([object()], 0)
