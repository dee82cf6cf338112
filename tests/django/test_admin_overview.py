"""The app's landing page in the admin is an overview: every name with in flight against its limit, waiting and
the oldest wait, a pause, the tasks rejected and expired in the last hour and the drift reconcile repaired in it —
busiest first — then the app's pages grouped by what an operator does there (live state, limits, history)."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa
from django.test import Client
from django.urls import reverse

from celery_keyed.ledger import Ledger
from tests.django.test_admin import APP, arrival, client_for, staff

pytestmark = pytest.mark.django_db


@pytest.fixture
def ledger(ledger_engine: sa.Engine) -> Ledger:
    return Ledger(ledger_engine, holder="worker-1:4242:beef", lease=60.0)


def rows_of(body: str) -> dict[str, list[str]]:
    """name -> the text of its cells, from the overview's table."""
    table = body[body.index('id="keyed-overview"') :]
    rows = re.findall(r'<th scope="row"><a href="[^"]*\?name=([^"]+)">[^<]+</a></th>(.*?)</tr>', table, flags=re.S)
    return {name: [re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r"<td[^>]*>(.*?)</td>", cells, re.S)]
            for name, cells in rows}


def test_the_app_page_is_an_overview_of_every_name_then_its_pages_grouped(
    admin_client: Client, ledger: Ledger, ledger_engine: sa.Engine
) -> None:
    ledger.admit(arrival("t-run", key="acct:1"))  # acct (a mutex): one running
    ledger.admit(arrival("t-wait", key="acct:1"))  # and one waiting
    ledger.admit(arrival("t-other", key="quiet:1"))  # a second name, less busy
    ledger.set_override("stripe", 0, reason="incident 231")  # a paused name
    with ledger_engine.begin() as conn:  # what the last hour's books and events hold, and an older rejection
        conn.exec_driver_sql(
            "INSERT INTO keyed_tasks (task_id, task_name, key, arrived_at, outcome, finished_at, detail) VALUES "
            "('r-1', 'proj.sync', 'acct:2', now(), 'rejected', now(), 'waiting room full'), "
            "('r-2', 'proj.sync', 'acct:3', now(), 'rejected', now(), 'waiting room full'), "
            "('x-1', 'proj.sync', 'acct:2', now(), 'expired', now(), 'waited past its deadline'), "
            "('r-old', 'proj.sync', 'acct:2', now() - interval '2 hours', 'rejected', now() - interval '2 hours', '')")
        conn.exec_driver_sql(
            "INSERT INTO keyed_events (kind, key, detail, at) VALUES ('drift', 'quiet:1', 'used 2 -> 1', now())")

    response = admin_client.get(reverse("admin:app_list", args=[APP]))
    assert response.status_code == 200
    body = response.content.decode()
    rows = rows_of(body)
    # in flight, limit per key, limit from, waiting, oldest wait, keys, rejected, expired, drift
    assert rows["acct"][:2] == ["1", "1"] and rows["acct"][3] == "1", rows["acct"]
    assert rows["acct"][6:] == ["2", "1", "0"], rows["acct"]  # the rejection two hours ago is not counted
    assert rows["quiet"][:3] == ["1", "1", "not configured: default (mutex)"], rows["quiet"]
    assert rows["quiet"][8] == "1", rows["quiet"]
    assert rows["stripe"][:3] == ["0", "paused", "override: incident 231"], rows["stripe"]
    assert next(iter(rows)) == "acct"  # the busiest first
    assert "2 rejected</a>" in body and "1 expired</a>" in body and "1 drift repaired</a>" in body
    # The pages, grouped, in the groups' order, each under its caption.
    groups = [body.index(f">{title}</a>") for title in ("Live state", "Limits", "History")]
    assert groups == sorted(groups)
    keys, overrides, outcomes = (body.index(f'href="{reverse(f"admin:{APP}_{m}_changelist")}"', groups[0])
                                 for m in ("key", "override", "taskrecord"))
    assert groups[0] < keys < groups[1] < overrides < groups[2] < outcomes


def test_whoever_may_see_one_page_sees_the_overview_and_only_the_groups_they_may_open(ledger: Ledger) -> None:
    ledger.admit(arrival("t-run", key="acct:1"))
    viewer = client_for(staff("viewer", "view_key"))
    body = viewer.get(reverse("admin:app_list", args=[APP])).content.decode()
    assert rows_of(body)["acct"][:2] == ["1", "1"]
    assert ">Live state</a>" in body and ">Limits</a>" not in body and ">History</a>" not in body
