"""The admin's waiting tasks show a debounced task (issue 14 item 2) in state "debounced" while it waits out its key's
quiet period, and list it under the "not due yet" filter."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from django.test import Client

from celery_keyed.ledger import Arrival, Ledger, Verdict
from tests.django.test_admin import url

pytestmark = pytest.mark.django_db


def test_a_debounced_task_is_shown_debounced(admin_client: Client, ledger_engine: sa.Engine) -> None:
    ledger = Ledger(ledger_engine, holder="worker-1:4242:beef", lease=60.0)
    debounced = Arrival("t-debounced", key="search:1", task_name="proj.reindex", message={"task": "proj.reindex"},
                        debounce=600.0)
    assert ledger.admit(debounced).verdict is Verdict.PARKED
    body = admin_client.get(url("waiting_changelist")).content.decode()
    assert "t-debounced" in body and ">debounced<" in body  # its state cell
    body = admin_client.get(url("waiting_changelist") + "?state=not_before").content.decode()
    assert "t-debounced" in body
