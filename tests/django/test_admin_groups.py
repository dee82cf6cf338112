"""The admin's held groups page: a group of a name whose group_failure is 'hold', held since its head failed, is
listed with its failed head and why; resume and skip the head each need their permission and a reason, go through
the ledger (audited, guarded by the hold) and start what they promoted."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from django.test import Client

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict, groups_register
from tests.django.test_admin import client_for, messages_of, scalar, staff, url

pytestmark = pytest.mark.django_db


@pytest.fixture
def ledger(ledger_engine: sa.Engine) -> Ledger:
    return Ledger(ledger_engine, holder="worker-1:4242:beef", lease=60.0)


def held_group(ledger: Ledger, group: str = "order:1") -> None:
    """``group`` of a 'hold' name: head h failed for good, n waits behind the hold."""
    ledger.configure({"order": NameConfig("order", group_failure="hold")})  # type: ignore[arg-type]
    for task_id in ("h", "n"):
        ledger.transaction(lambda c, t=task_id: groups_register(c, group, t))
    head = ledger.admit(Arrival("h", group_key=group, group_seq=1, task_name="proj.step", message={}))
    assert head.verdict is Verdict.ADMITTED
    assert ledger.admit(Arrival("n", group_key=group, group_seq=2, task_name="proj.step", message={})).verdict \
        is Verdict.PARKED
    assert head.fence is not None
    ledger.release(Token("h", 0), head.fence, Outcome.FAILED, detail="ValueError('bad row')")
    assert ledger.group_hold(group) is not None


def test_a_held_group_is_listed_with_its_failed_head_and_why(admin_client: Client, ledger: Ledger) -> None:
    assert "No group is held" in admin_client.get(url("heldgroup_changelist")).content.decode()
    held_group(ledger)
    ledger.transaction(lambda c: groups_register(c, "order:2", "other"))  # a group that is not held: not listed
    body = admin_client.get(url("heldgroup_changelist")).content.decode()
    assert "order:1" in body and "order:2" not in body
    assert "its head h (attempt 0) failed: ValueError(&#x27;bad row&#x27;)" in body
    assert '<td class="field-members_display">1</td>' in body  # n waits; h (dead-lettered) left the group


def test_resume_asks_for_a_reason_then_starts_the_next_number(
    admin_client: Client, ledger: Ledger, ledger_engine: sa.Engine
) -> None:
    held_group(ledger)
    form = {"action": "resume_action", "_selected_action": ["order:1"]}
    assert "the head&#x27;s retry runs" in admin_client.post(url("heldgroup_changelist"), form).content.decode()
    assert ledger.group_hold("order:1") is not None  # nothing changed before the confirmation
    response = admin_client.post(url("heldgroup_changelist"), {**form, "post": "yes", "reason": "fixed the parser"},
                                 follow=True)
    assert any("resumed for 1 group" in m for m in messages_of(response))
    assert ledger.group_hold("order:1") is None
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_claims WHERE task_id = 'n'") == 1  # promoted
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_waiting") == 0
    assert "No group is held" in admin_client.get(url("heldgroup_changelist")).content.decode()


def test_skip_dead_letters_the_head_and_moves_on(
    admin_client: Client, ledger: Ledger, ledger_engine: sa.Engine
) -> None:
    held_group(ledger)
    response = admin_client.post(url("heldgroup_changelist"), {
        "action": "skip_action", "_selected_action": ["order:1"], "post": "yes", "reason": "bad event"}, follow=True)
    assert any("skipped its head for 1 group" in m for m in messages_of(response))
    assert ledger.group_hold("order:1") is None
    assert scalar(ledger_engine, "SELECT outcome FROM keyed_tasks WHERE task_id = 'h'") == "dead_lettered"
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_claims WHERE task_id = 'n'") == 1


def test_without_a_reason_nothing_changes(admin_client: Client, ledger: Ledger) -> None:
    held_group(ledger)
    response = admin_client.post(url("heldgroup_changelist"), {
        "action": "resume_action", "_selected_action": ["order:1"], "post": "yes", "reason": ""})
    assert "Say why" in response.content.decode()
    assert ledger.group_hold("order:1") is not None


def test_resume_and_skip_need_their_permission(ledger: Ledger) -> None:
    held_group(ledger)
    viewer = client_for(staff("viewer", "view_heldgroup"))
    assert "order:1" in viewer.get(url("heldgroup_changelist")).content.decode()
    for action in ("resume_action", "skip_action"):
        viewer.post(url("heldgroup_changelist"), {"action": action, "_selected_action": ["order:1"], "post": "yes",
                                                  "reason": "x"})
        assert ledger.group_hold("order:1") is not None
    operator = client_for(staff("operator", "view_heldgroup", "release_groups"))
    operator.post(url("heldgroup_changelist"), {"action": "resume_action", "_selected_action": ["order:1"],
                                                "post": "yes", "reason": "x"})
    assert ledger.group_hold("order:1") is None
