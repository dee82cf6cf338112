"""The admin with newest wins (issue 14 item 1): a claim whose cancellation a newer arrival asked for says so."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from django.test import Client

from celery_keyed.ledger import Arrival, Ledger, Verdict
from tests.django.test_admin import url

pytestmark = pytest.mark.django_db


def test_a_claim_with_a_cancel_requested_says_so(admin_client: Client, ledger_engine: sa.Engine) -> None:
    ledger = Ledger(ledger_engine, holder="worker-1:4242:beef", lease=60.0)

    def render(task_id: str) -> Arrival:
        return Arrival(task_id, key="doc:1", task_name="proj.render", on_newer="cancel_running", message={})

    assert ledger.admit(render("t-old")).verdict is Verdict.ADMITTED
    body = admin_client.get(url("claim_changelist")).content.decode()
    assert "t-old" in body and "cancel requested" not in body
    assert ledger.admit(render("t-new")).verdict is Verdict.PARKED
    body = admin_client.get(url("claim_changelist")).content.decode()
    assert "cancel requested" in body and "superseded by t-new (newest wins)" in body
