"""The overview: the app's landing page in the admin (``/admin/celery_keyed_django/``). First every name the ledger
knows — in flight against its limit, waiting and the oldest wait, a pause, the tasks rejected and expired in the last
hour, the drift reconcile repaired in it — busiest first; then the app's pages grouped by what an operator does
there: the live state, the limits, the history. Read in one transaction under the admin's statement timeout, through
the same status views as ``celery keyed status``; nothing here writes.

Rendered by ``templates/admin/celery_keyed_django/app_index.html`` through the ``keyed_admin`` template tags.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery_keyed.ledger import NameStatus, RecentStatus, status_names, status_now, status_prepare, status_recent
from celery_keyed_django import ledger as ledger_access
from celery_keyed_django.admin.rendering import UNCONFIGURED, _url, age

#: Seconds of history the overview counts (rejections, expiries, drift).
RECENT = 3600.0

#: Most names the overview lists (the busiest first); the Keys page has every one.
MOST_NAMES = 50

#: Seconds the overview's reads may take before it says the ledger is slow instead of waiting.
READ_TIMEOUT = 5.0

#: The app's pages by what an operator does there, in this order (model object names); a page not listed goes last.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Live state", ("Key", "Claim", "Waiting", "HeldGroup", "Holder", "Sent", "Outbox")),
    ("Limits", ("Override", "Name", "KeyOverride", "FairWeightOverride")),
    ("History", ("TaskRecord", "OverrideLog", "FairWeightLog", "Event")),
)


@dataclass(frozen=True)
class NameRow:
    """One name of the overview, as the page shows it."""

    name: str
    in_flight: int
    limit: str  # the effective limit in words: "10", "paused", ...
    source: str
    waiting: int
    oldest_wait: str
    keys: str
    rejected: int
    expired: int
    drift: int
    keys_url: str
    paused: bool


@dataclass(frozen=True)
class Overview:
    names: list[NameRow]
    more: int  # names not listed (past MOST_NAMES)
    totals: dict[str, int]
    error: str | None = None
    rejected_url: str = ""
    expired_url: str = ""
    events_url: str = ""


def _source_words(status: NameStatus) -> str:
    if status.source == "default":
        return UNCONFIGURED
    if status.source == "override":
        return "override" + (f": {status.override_reason}" if status.override_reason else "")
    return "configured"


def _row(status: NameStatus, recent: RecentStatus) -> NameRow:
    oldest = status.oldest_waiting_age
    return NameRow(
        name=status.name,
        in_flight=status.in_flight,
        limit="paused" if status.paused else str(status.limit),
        source=_source_words(status),
        waiting=status.waiting,
        oldest_wait=age(timedelta(seconds=oldest)) if oldest is not None else "—",
        keys=f"{status.busy_keys} busy of {status.keys}",
        rejected=recent.rejected,
        expired=recent.expired,
        drift=recent.drift,
        keys_url=_url("key_changelist", query={"name": status.name}),
        paused=status.paused,
    )


def overview() -> Overview:
    """The overview's names and totals, read now (an ``error`` instead when the ledger cannot be read)."""
    links = {
        "rejected_url": _url("taskrecord_changelist", query={"outcome": "rejected", "finished": "1h"}),
        "expired_url": _url("taskrecord_changelist", query={"outcome": "expired", "finished": "1h"}),
        "events_url": _url("event_changelist", query={"kind__exact": "drift"}),
    }
    try:
        with ledger_access.ledger_engine().begin() as conn:
            status_prepare(conn, timeout=READ_TIMEOUT)
            now = status_now(conn)
            names = status_names(conn, now=now)
            recent = status_recent(conn, seconds=RECENT, now=now)
    except Exception as exc:  # the page still lists the app's pages; says why the numbers are missing
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return Overview([], 0, {}, error=f"{type(exc).__name__}: {first[:300]}", **links)
    quiet = RecentStatus()
    rows = [_row(status, recent.get(status.name, quiet)) for status in names]
    rows.sort(key=lambda r: (-(r.in_flight + r.waiting), -(r.rejected + r.expired + r.drift), r.name))
    totals = {
        "names": len(rows),
        "in_flight": sum(r.in_flight for r in rows),
        "waiting": sum(r.waiting for r in rows),
        "paused": sum(1 for r in rows if r.paused),
        "rejected": sum(r.rejected for r in recent.values()),
        "expired": sum(r.expired for r in recent.values()),
        "drift": sum(r.drift for r in recent.values()),
    }
    return Overview(rows[:MOST_NAMES], max(0, len(rows) - MOST_NAMES), totals, **links)


def grouped(app_list: list[dict[str, Any]], app_label: str) -> list[dict[str, Any]]:
    """The app's entry of the admin's ``app_list`` split into one entry per group of ``GROUPS`` (the shape
    ``admin/app_list.html`` renders), each with the pages of its group the user may see, in the group's order."""
    app = next((entry for entry in app_list if entry.get("app_label") == app_label), None)
    if app is None:
        return app_list
    models = {model["object_name"]: model for model in app["models"]}
    placed: set[str] = set()
    groups = []
    for title, names in GROUPS:
        members = [models[name] for name in names if name in models]
        placed.update(name for name in names if name in models)
        if members:
            groups.append({**app, "name": title, "models": members})
    rest = [model for name, model in models.items() if name not in placed]
    if rest:
        groups.append({**app, "name": "Other", "models": rest})
    return groups
