"""The operators' admin on real Postgres: every page renders (and says so when empty), overrides go through the
ledger (audit trail, promotions), permissions hold, forced releases are fenced, waiting tasks cancel through the
ledger's revoke, and the live view of keys stays a bounded number of queries on 100,000 keys."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict
from celery_keyed.ledger.admin_queries import force_release

pytestmark = pytest.mark.django_db

APP = "celery_keyed_django"


def url(name: str, *args: Any) -> str:
    return reverse(f"admin:{APP}_{name}", args=args)


def arrival(task_id: str, key: str = "acct:1", **kwargs: Any) -> Arrival:
    return Arrival(task_id, key=key, task_name="proj.sync", queue="celery", message={"task": "proj.sync"}, **kwargs)


@pytest.fixture
def ledger(ledger_engine: sa.Engine) -> Ledger:
    return Ledger(ledger_engine, holder="worker-1:4242:beef", lease=60.0)


def rows(engine: sa.Engine, sql: str, **params: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text(sql), params))


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def staff(username: str, *perms: str) -> User:
    user = User.objects.create_user(username, password="pw", is_staff=True)
    for codename in perms:
        user.user_permissions.add(Permission.objects.get(content_type__app_label=APP, codename=codename))
    return user


def client_for(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def messages_of(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]] if response.context else []


# -- pages -------------------------------------------------------------------------------------------------------


def test_every_page_renders_with_data(admin_client: Client, ledger: Ledger, ledger_engine: sa.Engine) -> None:
    ledger.configure({"acct": NameConfig("acct", 1)})
    assert ledger.admit(arrival("t-run")).verdict is Verdict.ADMITTED
    assert ledger.admit(arrival("t-wait")).verdict is Verdict.PARKED
    done = ledger.admit(arrival("t-done", key="other:1"))
    ledger.release(Token("t-done", 0), done.fence, Outcome.COMPLETED)
    ledger.set_override("acct", 0, reason="more room", author="alice")

    pages = {
        "key_changelist": ["acct:1", "other:1", "override", "default (mutex)"],
        "claim_changelist": ["t-run", "worker-1:4242:beef", "force_release_action", "Force release the selected"],
        "waiting_changelist": ["t-wait", "in line", "Cancel (revoke) the selected tasks"],
        "taskrecord_changelist": ["t-done", "completed", "in progress", "Explain a task"],
        "override_changelist": ["acct", "more room", "alice", "Clear…"],
        "overridelog_changelist": ["acct", "more room", "configured → 0 (paused)"],
        "name_changelist": ["acct", "0 (paused) (override)"],
        "event_changelist": ["No events"],
    }
    for page, texts in pages.items():
        response = admin_client.get(url(page))
        assert response.status_code == 200, page
        body = response.content.decode()
        for text in texts:
            assert text in body, f"{page}: {text!r} missing"
    response = admin_client.get(url("override_change", "acct"))
    assert response.status_code == 200
    assert "Audit trail" in response.content.decode() and "alice" in response.content.decode()


def test_empty_pages_say_why(admin_client: Client) -> None:
    expected = {
        "key_changelist": "No keys yet",
        "claim_changelist": "No claims: no keyed task is running",
        "waiting_changelist": "Nobody is waiting",
        "taskrecord_changelist": "No keyed task has arrived yet",
        "override_changelist": "No overrides",
    }
    for page, text in expected.items():
        assert text in admin_client.get(url(page)).content.decode(), page


def test_explain_panel(admin_client: Client, ledger: Ledger) -> None:
    ledger.admit(arrival("t-run"))
    ledger.admit(arrival("t-wait"))
    body = admin_client.get(url("explain"), {"task_id": "t-wait"}).content.decode()
    assert "Waiting behind 0 others for key acct:1 (in flight 1/1)" in body
    body = admin_client.get(url("explain"), {"task_id": "nope"}).content.decode()
    assert "The ledger has no record of this task id" in body.replace("&#x27;", "'")


# -- overrides -----------------------------------------------------------------------------------------------------


def post_override(client: Client, name: str, limit: Any, reason: str = "incident INC-1", **extra: Any) -> Any:
    data = {"name": name, "slot_limit": limit, "reason": reason, "expires_at_0": "", "expires_at_1": "", **extra}
    return client.post(url("override_add"), data, follow=True)


def test_override_pause_change_clear_through_the_ledger_with_audit(
    admin_client: Client, ledger: Ledger, ledger_engine: sa.Engine
) -> None:
    ledger.configure({"acct": NameConfig("acct", 1)})
    response = post_override(admin_client, "acct", 0, "Stripe is down")
    assert response.status_code == 200
    assert any("Name “acct” is now paused" in m for m in messages_of(response))
    assert scalar(ledger_engine, "SELECT slot_limit FROM keyed_overrides WHERE name = 'acct'") == 0
    # Paused: a new arrival waits.
    assert ledger.admit(arrival("t1")).verdict is Verdict.PARKED

    response = admin_client.post(
        url("override_change", "acct"),
        {"slot_limit": 3, "reason": "recovering", "expires_at_0": "", "expires_at_1": ""},
        follow=True,
    )
    assert response.status_code == 200, response.content
    # set_override promoted the waiter in the same transaction (a raw ORM save would not have).
    assert scalar(ledger_engine, "SELECT state FROM keyed_claims WHERE task_id = 't1'") == "promoted"

    response = admin_client.post(url("override_clear", "acct"), {"reason": "incident over"}, follow=True)
    assert response.status_code == 200
    assert any("cleared" in m for m in messages_of(response))
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_overrides") == 0

    log = rows(ledger_engine, "SELECT action, new_limit, reason, author FROM keyed_override_log ORDER BY id")
    assert [tuple(r) for r in log] == [
        ("set", 0, "Stripe is down", "admin"),
        ("set", 3, "recovering", "admin"),
        ("clear", None, "incident over", "admin"),
    ]
    body = admin_client.get(url("overridelog_changelist")).content.decode()
    assert "Stripe is down" in body and "→ 3" in body and "3 → configured" in body


def test_audit_trail_records_the_old_limit_of_a_change(admin_client: Client, ledger_engine: sa.Engine) -> None:
    post_override(admin_client, "acct", 0, "Stripe is down")
    admin_client.post(url("override_change", "acct"),
                      {"slot_limit": 3, "reason": "recovering", "expires_at_0": "", "expires_at_1": ""})
    log = rows(ledger_engine, "SELECT old_limit, new_limit FROM keyed_override_log ORDER BY id")
    assert [tuple(r) for r in log] == [(None, 0), (0, 3)]


def test_override_with_expiry(admin_client: Client, ledger_engine: sa.Engine) -> None:
    later = datetime.now(UTC) + timedelta(days=1)
    response = post_override(
        admin_client, "acct", 2, expires_at_0=later.strftime("%Y-%m-%d"), expires_at_1=later.strftime("%H:%M:%S")
    )
    assert response.status_code == 200
    expires = scalar(ledger_engine, "SELECT expires_at FROM keyed_overrides WHERE name = 'acct'")
    assert abs((expires - later).total_seconds()) < 2


@pytest.mark.parametrize(
    ("name", "limit", "reason", "error"),
    [
        ("acct", -1, "x", "The limit cannot be negative"),
        ("acct", 10**12, "x", "The limit can be at most 1073741823 (what the ledger can store)."),
        ("acct", "1.5", "x", "Enter a whole number: 0 or more"),
        ("acct", "", "x", "Enter a limit: 0 pauses the name."),
        ("acct", 1, "   ", "Say why: the reason is kept in the audit trail."),
        ("acct:1", 1, "x", "is not a valid name"),
        ("9lives", 1, "x", "is not a valid name"),
    ],
)
def test_override_validation(
    admin_client: Client, ledger_engine: sa.Engine, name: str, limit: Any, reason: str, error: str
) -> None:
    response = post_override(admin_client, name, limit, reason)
    assert error in response.content.decode().replace("&#x27;", "'")
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_overrides") == 0


def test_past_expiry_is_refused(admin_client: Client, ledger_engine: sa.Engine) -> None:
    response = post_override(admin_client, "acct", 1, expires_at_0="2020-01-01", expires_at_1="10:00")
    assert "The expiry is in the past" in response.content.decode()
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_overrides") == 0


def test_unknown_name_is_allowed_but_flagged(admin_client: Client, ledger_engine: sa.Engine) -> None:
    response = post_override(admin_client, "typo", 0)
    assert any("not a configured name" in m and "check the spelling" in m for m in messages_of(response))
    assert scalar(ledger_engine, "SELECT slot_limit FROM keyed_overrides WHERE name = 'typo'") == 0
    assert "not configured" in admin_client.get(url("override_changelist")).content.decode()


# -- permissions ---------------------------------------------------------------------------------------------------


def test_non_staff_is_sent_to_login(ledger_engine: sa.Engine) -> None:
    user = User.objects.create_user("visitor", password="pw")
    client = client_for(user)
    for page in ("key_changelist", "override_changelist", "override_add", "claim_changelist"):
        response = client.get(url(page))
        assert response.status_code == 302 and "/login/" in response["Location"], page
    response = client.post(url("override_add"), {"name": "acct", "slot_limit": 0, "reason": "x"})
    assert response.status_code == 302 and "/login/" in response["Location"]
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_overrides") == 0


def test_staff_without_the_permission_can_look_but_not_change(ledger: Ledger, ledger_engine: sa.Engine) -> None:
    ledger.set_override("acct", 2, reason="set by code")
    ledger.admit(arrival("t-run", key="other:1"))
    client = client_for(staff("viewer", "view_override", "view_key", "view_claim"))
    assert client.get(url("override_changelist")).status_code == 200
    assert client.get(url("key_changelist")).status_code == 200
    assert client.get(url("override_add")).status_code == 403
    response = client.post(url("override_add"), {"name": "acct", "slot_limit": 0, "reason": "x"})
    assert response.status_code == 403
    response = client.post(url("override_change", "acct"), {"slot_limit": 0, "reason": "x"})
    assert response.status_code == 403
    assert client.post(url("override_clear", "acct"), {"reason": "x"}).status_code == 403
    assert scalar(ledger_engine, "SELECT slot_limit FROM keyed_overrides WHERE name = 'acct'") == 2
    # No force-release action without its permission: posting it anyway changes nothing.
    page = client.get(url("claim_changelist")).content.decode()
    assert "force_release_action" not in page
    fence = scalar(ledger_engine, "SELECT fence FROM keyed_claims")
    client.post(url("claim_changelist"), {"action": "force_release_action", "_selected_action": [fence],
                                          "post": "yes", "reason": "x"})
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_claims") == 1


def test_staff_with_the_permission_can_change_limits(ledger_engine: sa.Engine) -> None:
    client = client_for(staff("operator", "change_limits"))
    assert client.get(url("override_add")).status_code == 200
    response = post_override(client, "acct", 0)
    assert response.status_code == 200
    assert scalar(ledger_engine, "SELECT author FROM keyed_override_log") == "operator"


# -- claims: forced release ----------------------------------------------------------------------------------------


def test_force_release_of_a_live_holder_asks_then_records_a_breach(
    admin_client: Client, ledger: Ledger, ledger_engine: sa.Engine
) -> None:
    running = ledger.admit(arrival("t-run"))
    assert ledger.admit(arrival("t-next")).verdict is Verdict.PARKED
    form = {"action": "force_release_action", "_selected_action": [running.fence]}
    response = admin_client.post(url("claim_changelist"), form)
    assert response.status_code == 200  # the confirmation page, nothing done yet
    body = response.content.decode()
    assert "held by a live worker" in body and "breach of the limit" in body
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_claims WHERE task_id = 't-run'") == 1

    response = admin_client.post(url("claim_changelist"), {**form, "post": "yes", "reason": ""})
    assert "Say why" in response.content.decode()  # the reason is required
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_claims WHERE task_id = 't-run'") == 1

    response = admin_client.post(url("claim_changelist"), {**form, "post": "yes", "reason": "hung on a socket"},
                                 follow=True)
    assert any("Released 1 claim" in m for m in messages_of(response))
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_claims WHERE task_id = 't-run'") == 0
    event = rows(ledger_engine, "SELECT kind, key, task_id, detail FROM keyed_events")
    assert [(e.kind, e.key, e.task_id) for e in event] == [("forced_release", "acct:1", "t-run")]
    assert "by admin: hung on a socket" in event[0].detail
    assert scalar(ledger_engine, "SELECT outcome FROM keyed_tasks WHERE task_id = 't-run'") == "revoked"
    # The freed slot went to the next in line, through the ledger's release-and-promote.
    assert scalar(ledger_engine, "SELECT state FROM keyed_claims WHERE task_id = 't-next'") == "promoted"
    # The stale worker's own release later is a no-op (fenced).
    assert not ledger.release(Token("t-run", 0), running.fence, Outcome.COMPLETED).released


def test_force_release_with_a_stale_fence_is_a_no_op(
    admin_client: Client, ledger: Ledger, ledger_engine: sa.Engine
) -> None:
    first = ledger.admit(arrival("t1"))
    # The attempt's worker was lost and the broker redelivered it: the same token is admitted again, new fence.
    ledger.release(Token("t1", 0), first.fence, Outcome.WORKER_LOST)
    second = ledger.admit(arrival("t1"))
    assert second.admitted and second.fence != first.fence

    # Directly: the ledger refuses the old fence.
    with ledger_engine.begin() as conn:
        result = force_release(conn, Token("t1", 0), first.fence, reason="stale page", author="admin")
    assert not result.released
    # Through the admin: a page showing the old fence changes nothing either.
    response = admin_client.post(
        url("claim_changelist"),
        {"action": "force_release_action", "_selected_action": [first.fence], "post": "yes", "reason": "stale"},
        follow=True,
    )
    assert any("changed meanwhile" in m for m in messages_of(response))
    assert scalar(ledger_engine, "SELECT fence FROM keyed_claims WHERE task_id = 't1'") == second.fence
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_events") == 0
    assert scalar(ledger_engine, "SELECT used FROM keyed_slots WHERE key = 'acct:1'") == 1


def test_force_release_of_a_lapsed_lease_is_a_reclaim(ledger: Ledger, ledger_engine: sa.Engine) -> None:
    past = datetime.now(UTC) - timedelta(minutes=10)
    dead = ledger.admit(arrival("t-dead"), now=past)
    with ledger_engine.begin() as conn:
        result = force_release(conn, Token("t-dead", 0), dead.fence, reason="worker host gone", author="bob")
    assert result.released and not result.breach
    assert scalar(ledger_engine, "SELECT kind FROM keyed_events") == "reclaimed"
    assert scalar(ledger_engine, "SELECT outcome FROM keyed_tasks WHERE task_id = 't-dead'") is None  # may come back
    assert scalar(ledger_engine, "SELECT used FROM keyed_slots WHERE key = 'acct:1'") == 0


# -- waiting: cancel -------------------------------------------------------------------------------------------------


def test_cancel_waiting_goes_through_revoke(admin_client: Client, ledger: Ledger, ledger_engine: sa.Engine) -> None:
    ledger.admit(arrival("t-run"))
    ledger.admit(arrival("t-wait"))
    arrival_no = scalar(ledger_engine, "SELECT arrival FROM keyed_waiting WHERE task_id = 't-wait'")
    form = {"action": "cancel_action", "_selected_action": [arrival_no]}
    assert "leave the line" in admin_client.post(url("waiting_changelist"), form).content.decode()
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_waiting") == 1
    response = admin_client.post(url("waiting_changelist"), {**form, "post": "yes", "reason": "duplicate job"},
                                 follow=True)
    assert any("Cancelled 1 waiting task" in m for m in messages_of(response))
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_waiting") == 0
    assert scalar(ledger_engine, "SELECT waiting FROM keyed_keys WHERE key = 'acct:1'") == 0
    assert scalar(ledger_engine, "SELECT outcome FROM keyed_tasks WHERE task_id = 't-wait'") == "revoked"


def test_cancel_needs_its_permission(ledger: Ledger, ledger_engine: sa.Engine) -> None:
    ledger.admit(arrival("t-run"))
    ledger.admit(arrival("t-wait"))
    arrival_no = scalar(ledger_engine, "SELECT arrival FROM keyed_waiting")
    client = client_for(staff("viewer", "view_waiting"))
    client.post(url("waiting_changelist"), {"action": "cancel_action", "_selected_action": [arrival_no],
                                            "post": "yes", "reason": "x"})
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_waiting") == 1


# -- the live view at scale ------------------------------------------------------------------------------------------


def test_live_view_of_100k_keys_is_a_bounded_number_of_queries(
    admin_client: Client, ledger: Ledger, ledger_engine: sa.Engine, django_assert_max_num_queries: Any
) -> None:
    ledger.configure({"acct": NameConfig("acct", 2)})
    ledger.set_override("tenant", 0, reason="paused for the test")
    with ledger_engine.begin() as conn:
        conn.execute(sa.text(
            """INSERT INTO keyed_keys (key, name, waiting, active_at)
               SELECT n || ':' || lpad(i::text, 6, '0'), n, CASE WHEN i % 1000 = 0 THEN 1 ELSE 0 END, now()
                 FROM generate_series(1, 50000) i, unnest(ARRAY['acct', 'tenant']) n"""))
        conn.execute(sa.text(
            """INSERT INTO keyed_slots (key, shard, name, used)
               SELECT key, 0, name, 1 FROM keyed_keys WHERE right(key, 2) = '07'"""))
        conn.execute(sa.text("ANALYZE keyed_keys; ANALYZE keyed_slots"))
    assert scalar(ledger_engine, "SELECT count(*) FROM keyed_keys") == 100_000
    pages = [
        {},
        {"state": "paused"},
        {"state": "waiting"},
        {"state": "running"},
        {"source": "config"},
        {"name": "acct", "p": "3"},
        {"q": "tenant:0420"},
    ]
    for params in pages:
        started = time.monotonic()
        with django_assert_max_num_queries(12):
            response = admin_client.get(url("key_changelist"), params)
        elapsed = time.monotonic() - started
        assert response.status_code == 200, params
        # Not a performance figure (a loaded CI machine took 5.2 s for a page): a page that loaded the 100k keys
        # into Python, or counted them row by row, would take minutes.
        assert elapsed < 60.0, (params, elapsed)
    body = admin_client.get(url("key_changelist"), {"state": "paused"}).content.decode()
    assert "tenant:000001" in body and "acct:000001" not in body
    body = admin_client.get(url("key_changelist"), {"q": "acct:000007"}).content.decode()
    assert "acct:000007" in body and "configuration" in body


@pytest.mark.parametrize("value", [1e300, float("nan"), -1, "soon"])
def test_the_admins_lease_and_dispatch_settings_have_the_workers_range(settings: Any, value: object) -> None:
    """Issue 9: a lease of 1e300 reached Postgres as make_interval(secs => 1e300) on the first force release."""
    from celery_keyed_django.ledger import get_ledger

    from celery_keyed.ledger.errors import InvalidConfig

    settings.CELERY_KEYED_LEASE = value
    with pytest.raises(InvalidConfig, match="CELERY_KEYED_LEASE must be a positive number of seconds"):
        get_ledger()
    settings.CELERY_KEYED_LEASE = "30"
    settings.CELERY_KEYED_DISPATCH_TIMEOUT = value
    with pytest.raises(InvalidConfig, match="CELERY_KEYED_DISPATCH_TIMEOUT must be a positive number of seconds"):
        get_ledger()
