"""The admin reads a name's limit and source from the ledger's ``keyed_limits`` (issue 12 item 1; migration 0020),
as ``celery keyed status`` does: the same numbers and the same labels (``override`` / ``config`` / ``default``) for
a configured name, a live and a lapsed override, a paused name, an override of an unconfigured name and a name known
only through its keys; its filters by limit source and by pause agree with them."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from celery_keyed_django.admin import _key_limit_and_source, _limit_and_source
from celery_keyed_django.models import Key, Name
from django.contrib import admin
from django.test import Client, RequestFactory

from celery_keyed.ledger import Ledger, NameConfig, status_keys, status_names
from tests.django.test_admin import arrival, url

pytestmark = pytest.mark.django_db

EXPECTED_NAMES = {
    "cfg": (3, "config"),
    "live": (5, "override"),
    "lapsed": (4, "config"),  # its override lapsed a minute ago (not swept yet)
    "paused": (0, "override"),
    "solo": (7, "override"),
    "plain": (1, "default"),
}


def _setup(ledger: Ledger, ledger_engine: sa.Engine) -> None:
    ledger.configure({n: NameConfig(n, limit) for n, limit in {"cfg": 3, "live": 2, "lapsed": 4, "paused": 4}.items()})
    ledger.set_override("live", 5, reason="more room", author="ops")
    ledger.set_override("paused", 0, reason="incident 42", author="ops")
    ledger.set_override("solo", 7, reason="not configured yet")
    with ledger_engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO keyed_overrides (name, slot_limit, reason, expires_at, set_at) "
                             "VALUES ('lapsed', 9, 'a burst', now() - interval '1 minute', now() - interval '1 hour')"))
    for key in ("cfg:1", "cfg:2", "live:1", "live:2", "lapsed:1", "paused:1", "solo:1", "plain:1"):
        ledger.admit(arrival(f"t-{key}", key=key))
    ledger.pause_key("cfg:2", 600, reason="vendor 429")
    ledger.set_key_limit("live:2", 1, reason="vendor header")
    with ledger_engine.begin() as conn:  # every key in the live view (a first claim may write its slot row only)
        conn.execute(sa.text("INSERT INTO keyed_keys (key, name, waiting, active_at) "
                             "SELECT key, name, 0, now() FROM keyed_slots ON CONFLICT (key) DO NOTHING"))


def test_the_admin_and_status_show_the_same_limits_and_labels(admin_client: Client, ledger_engine: sa.Engine) -> None:
    ledger = Ledger(ledger_engine, holder="worker-1:4242:beef", lease=60.0)
    _setup(ledger, ledger_engine)
    with ledger_engine.begin() as conn:
        names = {n.name: (n.limit, n.source) for n in status_names(conn)}
        keys = {k.key: (k.limit, k.source) for k in status_keys(conn, limit=100, idle=True)}
    assert names == EXPECTED_NAMES
    assert keys["cfg:2"] == (0, "key_paused") and keys["live:2"] == (1, "key")

    request = RequestFactory().get("/")
    admin_keys = list(admin.site._registry[Key].get_queryset(request))
    assert {k.key for k in admin_keys} == set(keys)
    for key in admin_keys:
        assert _limit_and_source(key) == names[key.name], key.key
        assert _key_limit_and_source(key) == keys[key.key], key.key
    admin_names = list(admin.site._registry[Name].get_queryset(request))
    assert {n.name: _limit_and_source(n) for n in admin_names} == {
        n: v for n, v in EXPECTED_NAMES.items() if n in ("cfg", "live", "lapsed", "paused")}

    def listed(**params: str) -> set[str]:
        body = admin_client.get(url("key_changelist"), params).content.decode()
        return {k for k in keys if f">{k}<" in body}

    assert listed() == set(keys)
    assert listed(source="override") == {"live:1", "live:2", "paused:1", "solo:1"}
    assert listed(source="config") == {"cfg:1", "cfg:2", "lapsed:1"}
    assert listed(source="default") == {"plain:1"}
    assert listed(state="paused") == {"paused:1"}
    body = admin_client.get(url("name_changelist")).content.decode()
    assert "3 (config)" in body and "0 (paused) (override)" in body and "(configured)" not in body


def test_the_names_list_shows_each_names_rate_per_key(ledger_engine: sa.Engine, admin_client: Client) -> None:
    """The token bucket and the rate windows, as the settings write them; a name's cap (and its cap key's row)."""
    Ledger(ledger_engine, holder="worker-1:4242:beef", lease=60.0).configure({
        "api": NameConfig("api", 5, rate="6/s", burst=3),
        "quota": NameConfig("quota", 2, windows=["100/m", "10000/d"]),
        "both": NameConfig("both", 1, rate="100/m", windows=[(5, 10)]),
        "plain": NameConfig("plain", 1),
        "tenant": NameConfig("tenant", 1, cap=20, borrow=True),
    })
    body = admin_client.get(url("name_changelist")).content.decode()
    assert "Rate per key" in body and "20, borrowing" in body and "tenant#cap" in body
    for shown in ("6/s, burst 3", "100/m; 10000/d", "100/m; 5/10s"):
        assert shown in body, shown
