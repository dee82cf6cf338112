"""The admin of weighted fair sharing (issue 14 item 5): fair weight overrides are set, changed and cleared through the
ledger (its audit trail), need the change_limits permission, and the configured names page shows the weights table."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from django.test import Client

from celery_keyed.ledger import Ledger, NameConfig
from tests.django.test_admin import client_for, messages_of, rows, scalar, staff, url

pytestmark = pytest.mark.django_db


def test_set_change_and_clear_a_fair_weight_through_the_ledger_with_audit(
    admin_client: Client, ledger_engine: sa.Engine
) -> None:
    Ledger(ledger_engine).configure({"crm": NameConfig("crm", limit=4, fair=True, fair_weights={"tenant:big": 2})})
    assert admin_client.get(url("fairweightoverride_changelist")).status_code == 200
    assert admin_client.get(url("fairweightoverride_add")).status_code == 200
    form = {"name": "crm", "prefix": "tenant:big", "weight": "3", "reason": "bought the big plan",
            "expires_at_0": "", "expires_at_1": ""}
    response = admin_client.post(url("fairweightoverride_add"), form, follow=True)
    assert response.status_code == 200, response.content
    assert any("now weigh 3" in m for m in messages_of(response)), messages_of(response)
    assert scalar(ledger_engine, "SELECT keyed_fair_weight('crm', 'tenant:big', NULL, now())") == 3.0
    page = admin_client.get(url("fairweightoverride_changelist")).content.decode()
    assert "tenant:big" in page and "bought the big plan" in page
    pk = scalar(ledger_engine, "SELECT id FROM keyed_fair_weight_overrides")
    response = admin_client.post(
        url("fairweightoverride_change", pk),
        {"weight": "4", "reason": "bigger plan", "expires_at_0": "", "expires_at_1": ""},
        follow=True,
    )
    assert response.status_code == 200, response.content
    assert scalar(ledger_engine, "SELECT weight FROM keyed_fair_weight_overrides") == 4.0
    assert admin_client.get(url("fairweightoverride_clear", pk)).status_code == 200
    response = admin_client.post(url("fairweightoverride_clear", pk), {"reason": "plan ended"}, follow=True)
    assert response.status_code == 200
    assert any("cleared" in m for m in messages_of(response))
    assert scalar(ledger_engine, "SELECT keyed_fair_weight('crm', 'tenant:big', NULL, now())") == 2.0  # the table's
    log = rows(ledger_engine, "SELECT action, old_weight, new_weight, reason, author FROM keyed_fair_weight_log"
                              " ORDER BY id")
    assert [tuple(r) for r in log] == [
        ("set", None, 3.0, "bought the big plan", "admin"),
        ("set", 3.0, 4.0, "bigger plan", "admin"),
        ("clear", 4.0, None, "plan ended", "admin"),
    ]
    assert admin_client.get(url("fairweightlog_changelist")).status_code == 200
    names = admin_client.get(url("name_changelist")).content.decode()
    assert "tenant:big" in names  # the configured table, on the configured names page


def test_bad_weights_are_refused_by_the_form(admin_client: Client, ledger_engine: sa.Engine) -> None:
    for weight, prefix in (("0", "tenant"), ("-1", "tenant"), ("x", "tenant"), ("2", "")):
        form = {"name": "crm", "prefix": prefix, "weight": weight, "reason": "r", "expires_at_0": "",
                "expires_at_1": ""}
        response = admin_client.post(url("fairweightoverride_add"), form)
        assert response.status_code == 200  # the form again, with its error
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_fair_weight_overrides") == 0


def test_setting_a_weight_needs_change_limits(ledger_engine: sa.Engine) -> None:
    viewer = client_for(staff("viewer", "view_fairweightoverride"))
    assert viewer.get(url("fairweightoverride_changelist")).status_code == 200
    form = {"name": "crm", "prefix": "t", "weight": "2", "reason": "r", "expires_at_0": "", "expires_at_1": ""}
    assert viewer.post(url("fairweightoverride_add"), form).status_code == 403
    operator = client_for(staff("operator", "change_limits"))
    assert operator.post(url("fairweightoverride_add"), form, follow=True).status_code == 200
    assert scalar(ledger_engine, "SELECT author FROM keyed_fair_weight_log") == "operator"
