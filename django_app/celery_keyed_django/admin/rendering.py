"""Small renderers the admin's pages share: durations and moments as an operator reads them, links to a page of the
admin and to a task's explanation, a stored message's arguments, the admin log entry of an operator's action."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django.contrib import admin
from django.contrib.admin.models import LogEntry
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.http import urlencode

APP = "celery_keyed_django"
CHANGE_LIMITS = f"{APP}.change_limits"

#: How every page says that a name is configured nowhere (its keys run at 1: a mutex).
UNCONFIGURED = "not configured: default (mutex)"

def age(delta: timedelta | None) -> str:
    """A duration as an operator reads it: ``45s``, ``3m 05s``, ``2h 04m``, ``3d 4h``."""
    if delta is None:
        return "—"
    seconds = int(delta.total_seconds())
    sign, seconds = ("-", -seconds) if seconds < 0 else ("", seconds)
    if seconds < 60:
        return f"{sign}{seconds}s"
    if seconds < 3600:
        return f"{sign}{seconds // 60}m {seconds % 60:02d}s"
    if seconds < 86400:
        return f"{sign}{seconds // 3600}h {seconds % 3600 // 60:02d}m"
    return f"{sign}{seconds // 86400}d {seconds % 86400 // 3600}h"


def since(moment: datetime | None) -> str:
    return "—" if moment is None else age(timezone.now() - moment)


#: The one way the admin writes a moment: in the project's time zone, to the second, with the zone's name.
MOMENT_FORMAT = "%Y-%m-%d %H:%M:%S %Z"


def moment(value: datetime | None) -> str:
    """A moment as every page of the admin writes it (``MOMENT_FORMAT``); "—" for none."""
    return "—" if value is None else timezone.localtime(value).strftime(MOMENT_FORMAT)


def moment_column(field: str, description: str) -> Callable[[Any], str]:
    """A list column showing the model's datetime ``field`` as ``moment`` writes it (Django would write it in the
    project's own date format), sortable by the field."""

    @admin.display(description=description, ordering=field)
    def column(obj: Any) -> str:
        return moment(getattr(obj, field))

    column.__name__ = f"{field}_moment"
    return column


def _url(name: str, *args: Any, query: dict[str, Any] | None = None) -> str:
    url = reverse(f"admin:{APP}_{name}", args=args)
    return f"{url}?{urlencode(query)}" if query else url


def explain_link(task_id: str) -> str:
    """A task id, shortened to its first 8 characters (the full id in the tooltip), linking to its explanation."""
    short = task_id if len(task_id) <= 12 else task_id[:8] + "…"
    return format_html('<a href="{}" title="{} — why is it (not) running?" style="white-space:nowrap">'
                       "<code>{}</code></a>", _url("explain", query={"task_id": task_id}), task_id, short)


def log_action(request: HttpRequest, objects: list[Any], flag: int, message: str) -> None:
    """Record an operator's action in Django's own admin log (the object's History, "Recent actions"), besides
    the ledger's audit trail; one entry per object."""
    if objects and request.user.is_authenticated:
        LogEntry.objects.log_actions(request.user.pk, objects, flag, change_message=message,
                                     single_object=len(objects) == 1)



def arguments_text(message: dict[str, Any] | None, limit: int = 120) -> str:
    """A stored message's arguments as Celery shows them (its ``argsrepr`` / ``kwargsrepr`` headers, which a task
    can set to hide secrets), shortened to ``limit`` characters."""
    headers = (message or {}).get("headers") or {}
    args, kwargs = headers.get("argsrepr"), headers.get("kwargsrepr")
    if args is None and kwargs is None:
        return "—"
    parts = [str(args)] if args not in (None, "()", "[]") else []
    if kwargs not in (None, "{}"):
        parts.append(str(kwargs))
    text = ", ".join(parts) or "no arguments"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def task_cell(task_id: str, task_name: str | None, message: dict[str, Any] | None, attempt: int) -> str:
    """One cell for a task on the live pages: its id (linking to its explanation), then its name and attempt, then
    its arguments, in smaller type — so that the pages fit a laptop's window with Django's two sidebars."""
    name = task_name or "—"
    if attempt:
        name = f"{name}, attempt {attempt + 1}"
    arguments = arguments_text(message, limit=60)
    return format_html(
        '{}<br><span class="keyed-sub">{}</span>{}', explain_link(task_id), name,
        format_html('<br><span class="keyed-sub keyed-quiet">{}</span>', arguments) if arguments != "—" else "",
    )


def _limit_text(limit: int | None, *, configured: bool = True) -> str:
    """A limit in an audit trail; None: no override, the name's configured limit — or, for a name configured
    nowhere, the default "1 (default)" (the words of ``celery keyed set-limit``)."""
    if limit is None:
        return "configured" if configured else "1 (default)"
    return "0 (paused)" if limit == 0 else str(limit)


def _promotions_text(promotions: list[Any], started: int) -> str:
    n = len(promotions)
    text = f"{n} waiting task{'s' if n != 1 else ''} got a slot at once"
    them = "them" if n != 1 else "it"
    if started < n:
        return text + f"; a worker starts {them} within the dispatch timeout (no Celery app here to publish {them})."
    return text + (" and were sent to the workers." if n != 1 else " and was sent to the workers.")

