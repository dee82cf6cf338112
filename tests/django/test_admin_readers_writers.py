"""The admin with an exclusive task (readers and writers, issue 14 item 6): the claim says it holds its key alone, and
the live keys count it as one task in flight, not as its EXCLUSIVE_COST slots."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from django.test import Client

from celery_keyed.ledger import EXCLUSIVE_COST, Arrival, Ledger, NameConfig, Verdict
from tests.django.test_admin import url

pytestmark = pytest.mark.django_db


def test_a_writer_is_one_task_alone_on_its_key(admin_client: Client, ledger_engine: sa.Engine) -> None:
    ledger = Ledger(ledger_engine, holder="worker-1:4242:beef", lease=60.0)
    ledger.configure({"doc": NameConfig("doc", 3)})
    writer = Arrival("t-writer", key="doc:1", cost=EXCLUSIVE_COST, task_name="proj.rewrite", message={})
    assert ledger.admit(writer).verdict is Verdict.ADMITTED
    assert ledger.admit(Arrival("t-reader", key="doc:1", task_name="proj.render", message={})).verdict is Verdict.PARKED
    body = admin_client.get(url("claim_changelist")).content.decode()
    assert "t-writer" in body and "exclusive: alone on its key" in body
    body = admin_client.get(url("key_changelist")).content.decode()
    assert str(EXCLUSIVE_COST) not in body
    assert 'doc%3A1">1</a>' in body or 'doc:1">1</a>' in body  # in flight: one task (a link to its claims)
