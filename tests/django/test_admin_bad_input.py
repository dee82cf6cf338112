"""Bad input to the admin is a 400 Bad Request, never a 500: a NUL character in the query string, the form or the
address (PostgreSQL's text refuses it), and a selection of rows that is not ids of the list's rows. Pages with good
input still answer as before."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from django.test import Client

from celery_keyed.ledger import Ledger, NameConfig, Verdict
from tests.django.test_admin import arrival, scalar, url

pytestmark = pytest.mark.django_db

#: Every list of the admin, with a filter or lookup of its own in the query string.
LISTS = {
    "claim_changelist": "state", "key_changelist": "state", "waiting_changelist": "key", "override_changelist": "name",
    "overridelog_changelist": "name", "name_changelist": "name", "taskrecord_changelist": "key",
    "event_changelist": "key", "sent_changelist": "key", "outbox_changelist": "key", "keyoverride_changelist": "key",
    "fairweightoverride_changelist": "name", "fairweightlog_changelist": "name",
}  # fmt: skip


@pytest.fixture
def quiet(admin_client: Client) -> Client:
    admin_client.raise_request_exception = False  # a view that raises answers 500, as in production
    return admin_client


def test_a_nul_in_the_query_string_is_a_bad_request(quiet: Client) -> None:
    for page, parameter in LISTS.items():
        assert quiet.get(url(page), {parameter: "\x00"}).status_code == 400, page
        assert quiet.get(url(page), {"q": "a\x00b"}).status_code == 400, page
        assert quiet.get(url(page)).status_code == 200, page
    assert quiet.get(url("explain"), {"task_id": "t\x00"}).status_code == 400
    assert quiet.get(url("override_add"), {"name": "\x00"}).status_code == 400


def test_a_nul_in_the_address_or_the_form_is_a_bad_request(quiet: Client, ledger_engine: sa.Engine) -> None:
    assert quiet.get(url("override_change", "a\x00")).status_code == 400
    assert quiet.post(url("override_clear", "a\x00"), {"reason": "r"}).status_code == 400
    response = quiet.post(url("override_add"), {"name": "acct", "slot_limit": 1, "reason": "a\x00b"})
    assert response.status_code == 400
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_overrides") == 0


def test_a_selection_that_is_not_ids_is_a_bad_request(quiet: Client, ledger_engine: sa.Engine) -> None:
    ledger = Ledger(ledger_engine, holder="worker-1:4242:beef", lease=60.0)
    ledger.configure({"acct": NameConfig("acct", 1)})
    assert ledger.admit(arrival("t-run")).verdict is Verdict.ADMITTED
    assert ledger.admit(arrival("t-wait")).verdict is Verdict.PARKED
    actions = {"claim_changelist": "force_release_action", "waiting_changelist": "cancel_action"}
    for page, action in actions.items():
        for selection in (["abc"], ["1.5"], ["1", "x"]):
            form: dict[str, Any] = {"action": action, "_selected_action": selection}
            assert quiet.post(url(page), form).status_code == 400, (page, selection)
            assert quiet.post(url(page), {**form, "post": "yes", "reason": "r"}).status_code == 400, (page, selection)
    # nothing was released or cancelled
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_claims") == 1
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_waiting") == 1
