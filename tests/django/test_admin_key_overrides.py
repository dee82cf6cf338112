"""The admin of per-key overrides (issue 14 item 4): pause a key and give it a limit of its own through the ledger
(audit rows, promotions), see it in the live keys view, resume it and clear its limit with a reason; only users with
``change_limits`` may write."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from django.contrib.admin.utils import quote
from django.test import Client

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Verdict
from tests.django.test_admin import arrival, client_for, messages_of, rows, scalar, staff, url

pytestmark = pytest.mark.django_db


def test_pause_a_key_and_resume_it(admin_client: Client, ledger_engine: sa.Engine) -> None:
    ledger = Ledger(ledger_engine, holder="worker-1:4242:beef", lease=60.0)
    ledger.configure({"acct": NameConfig("acct", 2)})
    response = admin_client.post(
        url("keyoverride_add"), {"key": "acct:1", "pause_for": "600", "reason": "vendor 429"}, follow=True
    )
    assert response.status_code == 200
    assert any("paused until" in m for m in messages_of(response)), messages_of(response)
    assert ledger.admit(arrival("t-wait", key="acct:1")).verdict is Verdict.PARKED
    assert ledger.admit(arrival("t-other", key="acct:2")).verdict is Verdict.ADMITTED
    body = admin_client.get(url("keyoverride_changelist")).content.decode()
    assert "acct:1" in body and "paused" in body and "vendor 429" in body
    keys = admin_client.get(url("key_changelist")).content.decode()
    assert "the key&#x27;s pause" in keys or "the key's pause" in keys
    change = admin_client.get(url("keyoverride_change", quote("acct:1"))).content.decode()
    assert "Audit trail" in change and "pause" in change
    done = admin_client.post(url("keyoverride_resume", "acct:1"), {"reason": "vendor ok"}, follow=True)
    assert done.status_code == 200 and any("resumed" in m for m in messages_of(done))
    assert [r.action for r in rows(ledger_engine, "SELECT action FROM keyed_override_log ORDER BY id")] == [
        "pause", "resume"]
    assert scalar(ledger_engine, "SELECT state FROM keyed_claims WHERE task_id = 't-wait'") == "promoted"


def test_give_a_key_its_own_limit_and_clear_it(admin_client: Client, ledger_engine: sa.Engine) -> None:
    response = admin_client.post(
        url("keyoverride_add"), {"key": "acct:9", "slot_limit": "4", "reason": "enterprise tenant"}, follow=True
    )
    assert response.status_code == 200
    assert scalar(ledger_engine, "SELECT slot_limit FROM keyed_key_overrides WHERE key = 'acct:9'") == 4
    cleared = admin_client.post(url("keyoverride_clear", "acct:9"), {"reason": "downgraded"}, follow=True)
    assert cleared.status_code == 200
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_key_overrides") == 0


def test_the_form_refuses_what_the_ledger_would(admin_client: Client, ledger_engine: sa.Engine) -> None:
    for data in (
        {"key": "bad key", "pause_for": "5", "reason": "x"},
        {"key": "acct:1", "reason": "x"},
        {"key": "acct:1", "slot_limit": "-1", "reason": "x"},
        {"key": "acct:1", "pause_for": "5", "reason": " "},
    ):
        response = admin_client.post(url("keyoverride_add"), data)
        assert response.status_code == 200 and response.context["adminform"].form.errors, data
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_key_overrides") == 0


def test_only_change_limits_may_write(ledger_engine: sa.Engine) -> None:
    viewer = client_for(staff("viewer", "view_keyoverride"))
    assert viewer.get(url("keyoverride_changelist")).status_code == 200
    assert viewer.post(url("keyoverride_add"), {"key": "acct:1", "pause_for": "5", "reason": "x"}).status_code == 403
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_key_overrides") == 0


def test_the_keys_view_shows_a_limit_computed_from_the_call(admin_client: Client, ledger_engine: sa.Engine) -> None:
    """A key whose latest call computed its limit (``concurrency_limit``) shows that limit, from "its latest call";
    an override of its name then wins, as in every claim."""
    import re

    ledger = Ledger(ledger_engine, holder="worker-1:4242:beef", lease=60.0)
    ledger.configure({"acct": NameConfig("acct", 1)})
    for i in range(3):
        ledger.admit(Arrival(f"t{i}", key="acct:gold", call_limit=5, message={"id": f"t{i}"}))

    def row_of(body: str, key: str) -> str:
        found = re.search(rf"<tr[^>]*>(?:(?!</tr>).)*{re.escape(key)}(?:(?!</tr>).)*</tr>", body, re.S)
        assert found is not None, key
        return found.group(0)

    gold = row_of(admin_client.get(url("key_changelist")).content.decode(), "acct:gold")
    assert ">5<br>" in gold and "its latest call" in gold
    ledger.set_override("acct", 2, reason="incident")
    gold = row_of(admin_client.get(url("key_changelist")).content.decode(), "acct:gold")
    assert ">2<br>" in gold and "its latest call" not in gold and "override" in gold
