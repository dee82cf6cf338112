"""A name's effective limit and its source, decided once in the database (issue 12 item 1; migration 0020):
``keyed_limits(now)`` lists every configured or overridden name with exactly ``keyed_effective_limit``'s answer (the
limit every claim reads), and status reads it, with one set of labels (``override`` / ``config`` / ``default``).
The Django admin reads the same function: tests/django/test_admin_limits.py."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger, NameConfig, status_keys, status_names

LABELS = {"override", "config", "default"}


def _setup(ledger: Ledger, now: datetime) -> None:
    """cfg: configured 3. live: configured 2, overridden 5 for a minute. lapsing: not configured, overridden 9 for
    a minute. paused: configured 4, overridden 0 (paused). solo: not configured, overridden 7. plain: not configured,
    never overridden, known only through a key."""
    ledger.configure({n: NameConfig(n, limit) for n, limit in {"cfg": 3, "live": 2, "paused": 4}.items()}, now=now)
    minute = now + timedelta(seconds=60)
    ledger.set_override("live", 5, reason="more room", author="ops", expires_at=minute, now=now)
    ledger.set_override("lapsing", 9, reason="a burst", author="ops", expires_at=minute, now=now)
    ledger.set_override("paused", 0, reason="incident 42", author="ops", now=now)
    ledger.set_override("solo", 7, reason="not configured yet", now=now)
    for name in ("cfg", "live", "lapsing", "paused", "solo", "plain"):
        ledger.admit(Arrival(f"t-{name}", key=f"{name}:1"), now=now)


def _limits(conn: sa.Connection, now: datetime) -> dict[str, dict[str, Any]]:
    rows = conn.execute(sa.text("SELECT * FROM keyed_limits(:now)"), {"now": now}).mappings().all()
    by_name = {r["name"]: dict(r) for r in rows}
    assert len(by_name) == len(rows), "keyed_limits lists a name twice"
    return by_name


def _effective(conn: sa.Connection, name: str, now: datetime) -> int:
    return int(conn.execute(sa.text("SELECT keyed_effective_limit(:name, :now)"), {"name": name, "now": now})
               .scalar_one())


NAMES = ("cfg", "live", "lapsing", "paused", "solo", "plain", "never-seen")


def test_keyed_limits_agrees_with_keyed_effective_limit(ledger: Ledger, engine: sa.Engine, clock: Any) -> None:
    start = clock()
    _setup(ledger, start)
    expected = {
        start: {"cfg": (3, "config"), "live": (5, "override"), "lapsing": (9, "override"),
                "paused": (0, "override"), "solo": (7, "override")},
        # both one-minute overrides have lapsed (the sweep has not run: their rows are still there)
        start + timedelta(seconds=120): {"cfg": (3, "config"), "live": (2, "config"), "paused": (0, "override"),
                                         "solo": (7, "override")},
    }
    with engine.connect() as conn:
        for now, listed in expected.items():
            limits = _limits(conn, now)
            assert {n: (r["slot_limit"], r["source"]) for n, r in limits.items()} == listed, now
            for name in NAMES:  # the claims' rule, name by name: a name keyed_limits does not list runs at 1
                row = limits.get(name)
                assert _effective(conn, name, now) == (1 if row is None else row["slot_limit"]), (name, now)
        assert conn.execute(sa.text("SELECT count(*) FROM keyed_overrides")).scalar_one() == 4  # nothing swept
        at_start = _limits(conn, start)
    assert (at_start["live"]["configured_limit"], at_start["live"]["override_reason"],
            at_start["live"]["override_author"]) == (2, "more room", "ops")
    assert at_start["live"]["override_expires_at"] == start + timedelta(seconds=60)
    assert (at_start["solo"]["configured_limit"], at_start["cfg"]["override_reason"]) == (None, None)


def test_status_reads_the_same_limits_and_labels(ledger: Ledger, engine: sa.Engine, clock: Any) -> None:
    start = clock()
    _setup(ledger, start)
    for now in (start, start + timedelta(seconds=120)):
        with engine.begin() as conn:
            limits = _limits(conn, now)
            names = {n.name: n for n in status_names(conn, now=now)}
            keys = {k.key: k for k in status_keys(conn, limit=100, idle=True, now=now)}
            assert set(names) == {"cfg", "live", "lapsing", "paused", "solo", "plain"}
            for name, status in names.items():
                row = limits.get(name)
                limit, source = (1, "default") if row is None else (row["slot_limit"], row["source"])
                assert (status.limit, status.source) == (limit, source), (name, now)
                assert status.limit == _effective(conn, name, now)
                assert status.configured_limit == (None if row is None else row["configured_limit"])
                assert status.override_reason == (None if row is None else row["override_reason"])
                # a key with no override of its own runs at its name's limit, from its name's source
                assert (keys[f"{name}:1"].limit, keys[f"{name}:1"].source) == (limit, source), (name, now)
            assert {n.source for n in names.values()} == LABELS
    with engine.begin() as conn:
        at_start = {n.name: (n.limit, n.source) for n in status_names(conn, now=start)}
    assert at_start == {"cfg": (3, "config"), "live": (5, "override"), "lapsing": (9, "override"),
                        "paused": (0, "override"), "solo": (7, "override"), "plain": (1, "default")}


def test_status_of_one_name_and_a_key_of_its_own(ledger: Ledger, engine: sa.Engine, clock: Any) -> None:
    """The name filter of status still applies, and a key's own rules build on its name's limit from keyed_limits."""
    start = clock()
    _setup(ledger, start)
    for key in ("cfg:2", "paused:2"):
        ledger.admit(Arrival(f"t-{key}", key=key), now=start)
    ledger.set_key_limit("cfg:2", 1, reason="vendor header", now=start)
    ledger.pause_key("paused:2", 60, reason="429", now=start)
    with engine.begin() as conn:
        assert [(n.name, n.limit, n.source) for n in status_names(conn, name="live", now=start)] == [
            ("live", 5, "override")]
        assert [(n.name, n.limit, n.source) for n in status_names(conn, name="plain", now=start)] == [
            ("plain", 1, "default")]
        keys = {k.key: (k.limit, k.source) for k in status_keys(conn, limit=100, idle=True, now=start)}
    assert keys["cfg:2"] == (1, "key")
    assert keys["paused:2"] == (0, "override")  # a paused name pauses every key: the name's source
