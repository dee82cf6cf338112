"""The operator's console, as an operator's tour found it: the audit trail says what a name without configuration
ran at before an override (1, the default, as the CLI says), and whoever may only look sees no "Clear…" or
"Resume…" button that would lead to a 403; the keys' "By name" filter lists a busy name that runs on the default
mutex."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa
from django.test import Client
from django.urls import reverse

from celery_keyed.ledger import Ledger
from tests.django.test_admin import APP, arrival, client_for, post_override, staff, url

pytestmark = pytest.mark.django_db


@pytest.fixture
def ledger(ledger_engine: sa.Engine) -> Ledger:
    return Ledger(ledger_engine, holder="worker-1:4242:beef", lease=60.0)


def test_the_audit_trail_of_an_unconfigured_name_says_it_was_1_by_default(
    admin_client: Client, ledger: Ledger
) -> None:
    post_override(admin_client, "solo", 3, "first limit of a new vendor")
    for page in (url("overridelog_changelist"), url("override_change", "solo")):
        body = admin_client.get(page).content.decode()
        assert "1 (default) → 3" in body, page
        assert "configured → 3" not in body, page
    # A configured name's entry still says "configured".
    post_override(admin_client, "acct", 0, "incident")
    assert "configured → 0 (paused)" in admin_client.get(url("overridelog_changelist")).content.decode()


def test_a_view_only_user_sees_no_clear_or_resume_buttons(admin_client: Client, ledger: Ledger) -> None:
    ledger.set_override("acct", 2, reason="set by code")
    ledger.set_fair_weight("acct", "tenant", 2.0, reason="big tenant")
    ledger.pause_key("acct:1", 600, reason="vendor 429")
    ledger.set_key_limit("acct:2", 1, reason="vendor header")
    pages = ("override_changelist", "fairweightoverride_changelist", "keyoverride_changelist")
    viewer = client_for(staff("viewer", "view_override", "view_fairweightoverride", "view_keyoverride"))
    for page in pages:
        response = viewer.get(url(page))
        assert response.status_code == 200, page
        body = response.content.decode()
        assert "Clear…" not in body and "Clear limit…" not in body and "Resume…" not in body, page
    # Whoever may change limits still has them.
    texts = {"override_changelist": ["Clear…"], "fairweightoverride_changelist": ["Clear…"],
             "keyoverride_changelist": ["Resume…", "Clear limit…"]}
    for page, wanted in texts.items():
        body = admin_client.get(url(page)).content.decode()
        for text in wanted:
            assert text in body, (page, text)


def test_the_keys_name_filter_lists_busy_names_on_the_default_mutex(admin_client: Client, ledger: Ledger) -> None:
    ledger.admit(arrival("t-run", key="plain:1"))  # a name configured nowhere: a mutex, one running
    ledger.admit(arrival("t-wait", key="plain:1"))  # and one waiting
    body = admin_client.get(url("key_changelist")).content.decode()
    assert 'href="?name=plain"' in body
    assert 'href="?name=acct"' in body  # configured names are still listed


def test_a_name_configured_nowhere_is_said_the_same_way_on_every_page(admin_client: Client, ledger: Ledger) -> None:
    ledger.set_override("solo", 2, reason="a new vendor")
    ledger.admit(arrival("t-plain", key="plain:1"))
    for page in ("override_changelist", "key_changelist"):
        body = admin_client.get(url(page)).content.decode()
        assert "not configured: default (mutex)" in body, page
        assert "⚠" not in body, page


def test_task_outcomes_tell_running_from_waiting(admin_client: Client, ledger: Ledger) -> None:
    ledger.admit(arrival("t-run"))
    ledger.admit(arrival("t-wait"))
    body = admin_client.get(url("taskrecord_changelist")).content.decode()
    assert "<em>running</em>" in body and "<em>waiting</em>" in body
    assert "<em>in progress</em>" not in body
    # The time shown for a finished task includes its wait, and says so.
    assert "Arrival to finish (wait + run)" in body and ">Took<" not in body


def test_task_outcomes_show_every_key_of_a_task_of_several_keys(
    admin_client: Client, ledger: Ledger, ledger_engine: sa.Engine
) -> None:
    """The books keep every key of a task of several keys, as it arrived — through the one-statement claim of a
    first arrival and through the general admission (a known task, a parked one) — and the task outcomes show them,
    also once the task is over."""
    from celery_keyed.ledger import Outcome, Token, Verdict

    fast = ledger.admit(arrival("t-multi", key="acct:1", extra_keys=("api:eu", "db:main")))
    assert fast.verdict is Verdict.ADMITTED
    assert ledger.admit(arrival("t-parked", key="acct:1", extra_keys=("api:us",))).verdict is Verdict.PARKED
    grouped = arrival("t-grouped", key="acct:2", extra_keys=("api:asia",), group_key="order:1")  # the general path
    assert ledger.admit(grouped).verdict is Verdict.ADMITTED
    ledger.release(Token("t-multi", 0), fast.fence, Outcome.COMPLETED)  # over: its keys stay in the books
    body = admin_client.get(url("taskrecord_changelist")).content.decode()
    assert "acct:1, api:eu, db:main" in body and "acct:1, api:us" in body and "acct:2, api:asia" in body
    with ledger_engine.connect() as conn:
        rows = dict(conn.exec_driver_sql("SELECT task_id, extra_keys FROM keyed_tasks").all())
    assert rows["t-multi"] == ["api:eu", "db:main"] and rows["t-parked"] == ["api:us"]
    assert rows["t-grouped"] == ["api:asia"]


#: Django's own way of writing a moment (the project's DATETIME_FORMAT, "Dec. 5, 2026, 8:25 p.m." by default) and an
#: ISO timestamp with its "T": neither appears on a page of the app, which writes every moment one way.
OTHER_FORMATS = re.compile(
    r"\b(?:Jan|Feb|March|April|May|June|July|Aug|Sept|Oct|Nov|Dec)\.? \d{1,2}, \d{4}|\d{4}-\d{2}-\d{2}T\d{2}:\d{2}"
)
ONE_FORMAT = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} [A-Z]{2,5}")


def test_every_page_writes_a_moment_one_way(admin_client: Client, ledger: Ledger, ledger_engine: sa.Engine) -> None:
    from django.contrib import admin as django_admin

    ledger.register_holder()
    ledger.admit(arrival("t-run", key="acct:1"))
    ledger.admit(arrival("t-wait", key="acct:1"))
    ledger.set_override("acct", 2, reason="set by code", expires_at=None)
    ledger.set_fair_weight("acct", "tenant", 2.0, reason="big tenant")
    ledger.pause_key("acct:1", 600, reason="vendor 429")
    ledger.set_key_limit("acct:2", 1, reason="vendor header")
    with ledger_engine.begin() as conn:
        conn.exec_driver_sql("INSERT INTO keyed_events (kind, key, detail, at) VALUES ('drift', 'acct:1', 'x', now())")
    pages = [url("explain") + "?task_id=t-wait", reverse("admin:app_list", args=[APP])]
    pages += [reverse(f"admin:{APP}_{model._meta.model_name}_changelist")
              for model in django_admin.site._registry if model._meta.app_label == APP]
    dated = 0
    for page in pages:
        response = admin_client.get(page)
        assert response.status_code == 200, page
        body = response.content.decode()
        assert not OTHER_FORMATS.search(body), (page, OTHER_FORMATS.search(body))
        dated += bool(ONE_FORMAT.search(body))
    assert dated >= 5  # the pages with moments on them write them the one way
