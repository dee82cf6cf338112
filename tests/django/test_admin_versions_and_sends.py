"""The admin shows the configuration version stored for each name and the version each worker runs (issue 14
item 7), the sends accepted and refused at send (item 3), and the outbox (item 8)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from django.test import Client
from django.urls import reverse

from celery_keyed.ledger import Arrival, Ledger, NameConfig

pytestmark = pytest.mark.django_db

APP = "celery_keyed_django"


@pytest.fixture(autouse=True)
def _no_sends_left(ledger_engine: sa.Engine) -> Iterator[None]:
    """tests/django/conftest.py empties the tables it lists after each test; these tables are new (0006)."""
    yield
    with ledger_engine.begin() as conn:
        for table in ("keyed_sent", "keyed_send_refusals", "keyed_holders"):
            conn.execute(sa.text(f"DELETE FROM {table}"))


def url(name: str, *args: Any) -> str:
    return reverse(f"admin:{APP}_{name}", args=args)


def test_workers_page_shows_versions(admin_client: Client, ledger_engine: sa.Engine) -> None:
    new = Ledger(ledger_engine, holder="host-a:11:aaaa")
    old = Ledger(ledger_engine, holder="host-b:22:bbbb")
    for ledger in (new, old):
        ledger.register_holder()
    new.configure({"acct": NameConfig("acct", 4)}, version=3)
    old.configure({"acct": NameConfig("acct", 1)}, version=2)
    body = admin_client.get(url("holder_changelist")).content.decode()
    assert "Workers" in body and "Configuration version stored: 3" in body
    assert "host-a" in body and "host-b" in body and "older than stored 3" in body
    names = admin_client.get(url("name_changelist")).content.decode()
    assert "Configuration version" in names and '<td class="field-config_version">3</td>' in names


def test_sends_page_shows_accepted_and_refused(admin_client: Client, ledger_engine: sa.Engine) -> None:
    ledger = Ledger(ledger_engine, holder="host-a:11:aaaa")
    ledger.configure({"feed": NameConfig("feed", 1, max_waiting=1)})
    assert ledger.admit_at_send("t-sent", "feed:1", dedupe_key="order:9").accepted
    assert not ledger.admit_at_send("t-refused", "feed:1").accepted
    body = admin_client.get(url("sent_changelist")).content.decode()
    assert "t-sent" in body and "order:9" in body and "t-refused" not in body
    assert "feed: 1 room full" in body


def test_empty_pages(admin_client: Client) -> None:
    assert "No worker has started" in admin_client.get(url("holder_changelist")).content.decode()
    body = admin_client.get(url("sent_changelist")).content.decode()
    assert "No accepted sends" in body
    assert "Refused sends (nothing published, nothing booked): none" in body


def test_outbox_page_shows_registered_not_received(admin_client: Client, ledger_engine: sa.Engine) -> None:
    """Issue 14 item 8: registrations not received yet, read-only, with how often they were republished."""
    ledger = Ledger(ledger_engine, holder="host-a:11:aaaa")
    message = {"task": "t", "body": "", "headers": {}, "properties": {}, "exchange": "", "routing_key": "celery"}
    assert ledger.register_at_publish("t-lost", message, task_name="proj.sync", key="acct:1", arrival_timeout=1)
    assert ledger.register_at_publish("t-received", message, key="acct:2")
    ledger.admit(Arrival("t-received", key="acct:2"))
    later = datetime.now(UTC) + timedelta(seconds=5)
    assert [d.task_id for d in ledger.outbox_due(arrival_timeout=60, now=later)] == ["t-lost"]
    body = admin_client.get(url("outbox_changelist")).content.decode()
    assert "t-lost" in body and "proj.sync" in body and "t-received" not in body
    assert "registered, not received, republished 1 time" in body
    assert admin_client.get(url("outbox_add")).status_code == 403
    assert "Nothing in the outbox" in _empty_outbox(admin_client, ledger_engine)


def _empty_outbox(admin_client: Client, ledger_engine: sa.Engine) -> str:
    with ledger_engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM keyed_outbox"))
    return admin_client.get(url("outbox_changelist")).content.decode()
